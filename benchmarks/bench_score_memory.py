"""Scoring memory: ``HFTextModel.score`` with ``lm_head`` in blocks of positions vs the whole chunk at once
vs the plain transformers path (full-sequence logits, as lm-eval's ``HFLM`` scores).

A teacher-forced score (reference NLL, a judge's verdict) needs the log-probability of every
continuation token. The logits behind it are ``[positions, vocab]`` float32: with SmolLM2's 49,152-token
vocabulary, a chunk of 16 reference answers of 512 tokens is 8,192 x 49,152 x 4 bytes = 1.5 GiB a tensor,
and the log-softmax makes a second. The smollm2-135m run peaked at 15 GiB in the driver there
(``results/smollm2-135m-2026-12-03/TIMINGS.md`` at 7c1b2ca, run 11).

Each measurement runs in a fresh subprocess (this file with ``--child MODE``): it loads the model,
tokenizes the pairs, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), scores, and
reports ``VmHWM`` minus the RSS just before scoring (the memory scoring added) and the wall time:
  blocked    ``HFTextModel.score`` as the pipeline runs it: ``lm_head`` and the log-softmax over at most
             ``SCORE_BLOCK_POSITIONS`` (1,024) positions at once (``darts_bench.evaluate.hf_model.position_blocks``)
  one_block  the same with the block unbounded: every continuation position of a chunk at once (the
             pipeline before blocks)
  library    the plain transformers path: ``model(input_ids, attention_mask).logits`` over every position of
             the chunk, ``log_softmax`` in float32, gather the continuation tokens (lm-eval ``HFLM``'s way)
  forward    the decoder body alone over the same chunks (``model.model``, left-padded, no ``lm_head``):
             the part of any path's memory that does not depend on how logits are held
All three batch the same token ids (``score_pairs``) in chunks of ``--batch-size`` pairs. The parent
checks that ``blocked`` gives ``one_block``'s token NLLs bitwise and ``library``'s within rounding.

    .venv/bin/python benchmarks/bench_score_memory.py --model-dir <SmolLM2 dir> [--pairs 32 --cont-tokens 512]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MODES = ("blocked", "one_block", "library", "forward")


def workload(tok, n_pairs: int, cont_tokens: int) -> tuple[list[str], list[str]]:
    """``n_pairs`` (context, continuation) strings: GSM8K questions, and shared-data text cut to
    ``cont_tokens`` tokens of ``tok``."""
    import common

    prompts = common.gsm8k_prompts(n_pairs)
    text = " ".join(common.corpus_texts())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_pairs * cont_tokens:
        raise SystemExit(f"the shared corpus has {len(ids)} tokens, fewer than {n_pairs} x {cont_tokens}")
    conts = [" " + tok.decode(ids[i * cont_tokens:(i + 1) * cont_tokens]).strip() for i in range(n_pairs)]
    return prompts, conts


def library_scores(model, pairs, pad_id: int, batch_size: int) -> list[list[float]]:
    """Token NLLs (nats) from the full forward's logits, chunk by chunk, right-padded."""
    import torch

    out = []
    for s in range(0, len(pairs), batch_size):
        chunk = pairs[s:s + batch_size]
        L = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([list(x) + [pad_id] * (L - len(x)) for x, _ in chunk])
        mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x, _ in chunk])
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # [b, L, vocab]
        for i, (x, n) in enumerate(chunk):
            e = len(x)
            tgt = ids[i, e - n:e]
            out.append((-logp[i, e - n - 1:e - 1].gather(-1, tgt[:, None])[:, 0]).tolist())
        del logp
    return out


def body_forward(model, pairs, pad_id: int, batch_size: int) -> list:
    """The decoder body over each chunk, left-padded as ``HFTextModel.score`` pads; returns no scores."""
    import torch

    from darts_bench.evaluate.hf_model import left_pad, positions_from_mask

    for s in range(0, len(pairs), batch_size):
        ids, mask = left_pad([x for x, _ in pairs[s:s + batch_size]], pad_id)
        with torch.inference_mode():
            model.model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))
    return []


def child(mode: str, model_dir: Path, n_pairs: int, cont_tokens: int, batch_size: int, threads: int,
          out: Path) -> None:
    import common
    import torch

    from darts_bench.evaluate import hf_model
    from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm, score_pairs

    common.set_threads(threads)
    model, tok = load_causal_lm(model_dir)
    contexts, conts = workload(tok, n_pairs, cont_tokens)
    tm = HFTextModel("bench", model, tok, batch_size=batch_size)
    pairs = score_pairs(tok, contexts, conts, tm.max_length)
    if mode == "one_block":
        hf_model.SCORE_BLOCK_POSITIONS = 1 << 40
    common.reset_peak_rss()  # VmHWM := VmRSS from here
    before = common.proc_status("VmRSS")
    t0 = time.perf_counter()
    if mode == "library":
        nll = library_scores(model, pairs, tok.pad_token_id, batch_size)
    elif mode == "forward":
        nll = body_forward(model, pairs, tok.pad_token_id, batch_size)
    else:
        nll = [s.token_nll for s in tm.score(contexts, conts)]
    wall = time.perf_counter() - t0
    out.write_text(json.dumps({"mode": mode, "extra_b": common.proc_status("VmHWM") - before, "before_b": before,
                               "wall_s": wall,
                               "positions": sum(n for _, n in pairs), "vocab": int(model.config.vocab_size),
                               "token_nll": nll, "threads": torch.get_num_threads()}))


def run_child(mode: str, args, tmp: Path) -> dict:
    import common

    out = tmp / f"{mode}.json"
    return common.child_json([sys.executable, str(HERE), "--child", mode, "--model-dir", str(args.model_dir_resolved),
                              "--pairs", str(args.pairs), "--cont-tokens", str(args.cont_tokens), "--batch-size",
                              str(args.batch_size), "--threads", str(args.threads), "--out", str(out)], out, mode)


def main() -> None:
    import common

    ap = common.parser(__doc__)
    ap.add_argument("--pairs", type=int, default=32, help="(context, continuation) pairs")
    ap.add_argument("--cont-tokens", type=int, default=512, help="continuation tokens per pair")
    ap.add_argument("--batch-size", type=int, default=16, help="pairs per forward (tasks.batch_size's default)")
    ap.add_argument("--child", default=None, help=argparse_hidden())
    ap.add_argument("--out", type=Path, default=None, help=argparse_hidden())
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model_dir, args.pairs, args.cont_tokens, args.batch_size, args.threads,
                     args.out)
    args.model_dir_resolved = common.model_dir(args)
    repeats = args.repeats or 1
    print(json.dumps(common.env_info(args.threads)))
    with tempfile.TemporaryDirectory(prefix="bench-score-") as d:
        res: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(repeats):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                res[mode].append(run_child(mode, args, Path(d)))
    first = {m: res[m][0] for m in MODES}
    n_pos, vocab = first["blocked"]["positions"], first["blocked"]["vocab"]
    extra = {m: min(x["extra_b"] for x in res[m]) for m in MODES}
    wall = {m: common.med([x["wall_s"] for x in res[m]]) for m in MODES}
    flat = {m: [v for row in first[m]["token_nll"] for v in row] for m in MODES}
    bitwise = flat["blocked"] == flat["one_block"]
    tok_abs = max(abs(a - b) for a, b in zip(flat["blocked"], flat["library"]))
    rel = max(abs(sum(a) - sum(b)) / abs(sum(b)) for a, b in zip(first["blocked"]["token_nll"],
                                                                   first["library"]["token_nll"]))
    print(f"model {args.model_dir_resolved}: vocab {vocab:,}; {args.pairs} pairs x {args.cont_tokens} continuation "
          f"tokens = {n_pos:,} scored positions in chunks of {args.batch_size} pairs; {args.threads} thread(s); "
          f"min peak / median time over {repeats} run(s), each in a fresh process")
    print(common.table(["path", "memory scoring added (MiB)", "above the body forward's (MiB)", "time (s)"],
                       [[m, f"{extra[m] / 2**20:,.0f}", f"{(extra[m] - extra['forward']) / 2**20:,.0f}",
                         f"{wall[m]:.1f}"] for m in MODES]))
    print(f"blocked vs one_block token NLLs: {'bitwise-equal' if bitwise else 'DIFFERENT'}; blocked vs library "
          f"(right padding, full logits): pair NLLs within {rel:.1e} relative, tokens within {tok_abs:.1e} nats")
    fwd = extra["forward"]
    common.summary(
        "score_memory",
        f"memory scoring added: one block {extra['one_block'] / extra['blocked']:.1f}x, library "
        f"{extra['library'] / extra['blocked']:.1f}x ours (blocks of 1,024 positions, "
        f"{extra['blocked'] / 2**20:,.0f} MiB, of which the body forward {fwd / 2**20:,.0f}); above the body "
        f"forward: one block {(extra['one_block'] - fwd) / 2**20:,.0f} MiB, library {(extra['library'] - fwd) / 2**20:,.0f}, "
        f"ours {(extra['blocked'] - fwd) / 2**20:,.0f}; time ours/one block {wall['blocked'] / wall['one_block']:.2f}, "
        f"ours/library {wall['blocked'] / wall['library']:.2f}",
        one_block_over_blocked=extra["one_block"] / extra["blocked"],
        library_over_blocked=extra["library"] / extra["blocked"], blocked_mib=extra["blocked"] / 2**20,
        time_ratio_blocked_one_block=wall["blocked"] / wall["one_block"],
        time_ratio_blocked_library=wall["blocked"] / wall["library"], identical=bitwise, max_rel_vs_library=rel,
        forward_mib=fwd / 2**20, max_token_abs_vs_library=tok_abs,
        positions=n_pos, vocab=vocab)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE.parent.parent))
    main()
