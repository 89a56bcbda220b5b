"""Shared set-up for the benchmarks in this folder.

* :func:`parser` -- the common flags: ``--tier {tiny,smollm2-135m}``, ``--model-dir DIR`` (a real
  checkpoint instead of the random tiny Llama), ``--threads N`` (torch intra-op threads, default 1),
  ``--repeats N``.
* :func:`model_dir` -- the model under test: ``--model-dir`` when given, else a random-init tiny
  Llama (hidden 128, 4 layers, intermediate 344, vocab 4096 from
  :func:`darts_bench.pool.tiny.train_tokenizer` on text from the shared data dir) built once into
  ``$DARTS_BENCH_BENCH_CACHE`` (set by ``run_all.py``, so all scripts share it) or a temp dir.
* :func:`interleave` -- time several code paths side by side, round-robin with the order reversed
  on every other round, and return every sample; ratios come from medians of those samples.

The machine these run on is usually shared, so every figure a script reports as a result is a
ratio of two paths measured in the same process run, interleaved; absolute times are printed for
context only.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DATA_DIR = Path(os.environ.get("DARTS_BENCH_DATA", str(ROOT.parent / "shared" / "data")))
CACHE_ENV = "DARTS_BENCH_BENCH_CACHE"

# Default workload sizes per tier: the tiny Llama is fast enough for the full sizes; SmolLM2-135M
# (about 100x the compute per token) gets smaller workloads so each script stays near 2 minutes.
TIERS: dict[str, dict] = {
    "tiny": {"collect_n": 64, "collect_len": 256, "collect_repeats": 5, "train_n": 16, "train_len": 128,
             "train_epochs": 2, "train_repeats": 5, "gen_prompts": 32, "gen_tokens": 64, "gen_repeats": 5,
             "merge_repeats": 2},
    "smollm2-135m": {"collect_n": 8, "collect_len": 192, "collect_repeats": 3, "train_n": 8, "train_len": 64,
                     "train_epochs": 1, "train_repeats": 3, "gen_prompts": 8, "gen_tokens": 32, "gen_repeats": 3,
                     "merge_repeats": 1},
}
TINY_ARCH = {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 344, "num_attention_heads": 4,
             "vocab_size": 4096}


# ------------------------------------------------------------------------------------ arguments
def parser(doc: str | None) -> argparse.ArgumentParser:
    first = (doc or "").strip().splitlines()[0] if doc else None
    ap = argparse.ArgumentParser(description=first, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", choices=sorted(TIERS), default="tiny",
                    help="workload sizes; with smollm2-135m pass --model-dir (a SmolLM2 checkpoint dir)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF checkpoint dir to benchmark instead of the random tiny Llama")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default per script)")
    return ap


def tier(args) -> dict:
    return TIERS[args.tier]


def set_threads(n: int) -> int:
    """Set torch's intra-op (and, where still possible, inter-op) threads; print and return it."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process (only allowed before parallel work)
        pass
    print(f"torch {torch.__version__}: {torch.get_num_threads()} intra-op thread(s), "
          f"{torch.get_num_interop_threads()} inter-op; nproc {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    return torch.get_num_threads()


# ------------------------------------------------------------------------------------- env info
def cpu_model() -> str:
    """The CPU's model name as ``results.json`` records it (``darts_bench.report.tables.cpu_record``)."""
    from darts_bench.report.tables import cpu_record

    return cpu_record()["model"] or "unknown"


def proc_status(key: str) -> int:
    """``key`` of ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``: kB there)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_peak_rss() -> None:
    """Set this process's ``VmHWM`` to its current RSS (``darts_bench.pipeline.reset_process_peak_rss``),
    so a later ``proc_status("VmHWM")`` is the peak from here on.

    Raises:
        RuntimeError: the kernel cannot reset it (no ``/proc/self/clear_refs``): a peak would be wrong.
    """
    from darts_bench.pipeline import reset_process_peak_rss

    if not reset_process_peak_rss():
        raise RuntimeError("cannot reset this process's peak RSS (/proc/self/clear_refs): a Linux >= 4.0 bench")


def child_json(argv: list[str], out: Path, what: str) -> dict:
    """Run ``argv`` (a benchmark's ``--child`` process, tqdm off) and return the JSON it wrote to ``out``.

    Raises:
        RuntimeError: the child failed (its stderr's tail in the message).
    """
    import subprocess

    p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if p.returncode != 0:
        raise RuntimeError(f"child {what} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def env_info(threads: int | None = None) -> dict:
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"), "nproc": os.cpu_count(),
            "cpu": cpu_model(), "torch": torch.__version__,
            "threads": threads if threads is not None else torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


# --------------------------------------------------------------------------------------- timing
class Timings:
    """Wall-clock and process-CPU seconds of every timed call: ``wall[path][round][unit]``,
    ``cpu[path][round][unit]``."""

    def __init__(self, names: list[str]):
        self.wall: dict[str, list[list[float]]] = {n: [] for n in names}
        self.cpu: dict[str, list[list[float]]] = {n: [] for n in names}

    def per_round(self, name: str, kind: str = "wall") -> list[float]:
        return [sum(r) for r in getattr(self, kind)[name]]

    def round_rows(self, prefix: str = "") -> list[list[str]]:
        """One :func:`table` row per path: ``[prefix + path, wall spread per round, cpu spread per round]``."""
        return [[prefix + p, spread(self.per_round(p)), spread(self.per_round(p, "cpu"))] for p in self.wall]

    def per_unit(self, name: str, kind: str = "wall") -> list[float]:
        return [x for r in getattr(self, kind)[name] for x in r]

    def ratio(self, a: str, b: str, kind: str = "wall") -> float:
        """Median over all (round, unit) pairs of ``a / b`` measured back to back."""
        return med([x / y for x, y in zip(self.per_unit(a, kind), self.per_unit(b, kind))])

    def best_ratio(self, a: str, b: str, kind: str = "cpu") -> float:
        """Median over units of ``min over rounds(a) / min over rounds(b)``: on a shared machine the
        noise is mostly added time, so each path's best time is the steadiest estimate of its cost."""
        A, B = getattr(self, kind)[a], getattr(self, kind)[b]
        return med([min(r[u] for r in A) / min(r[u] for r in B) for u in range(len(A[0]))])

    def total_ratio(self, a: str, b: str, kind: str = "wall") -> float:
        """``sum(a) / sum(b)`` over every timed call."""
        return sum(self.per_unit(a, kind)) / sum(self.per_unit(b, kind))


def interleave(paths: dict[str, Callable[[int], object]], repeats: int, warmup: int = 1, units: int = 1) -> Timings:
    """Time several code paths side by side.

    The work is split into ``units`` pieces (e.g. batches); each path is a callable ``fn(u)`` doing
    piece ``u``. After ``warmup`` untimed calls of every path on unit 0, ``repeats`` rounds run
    every piece on every path back to back, the path order rotated from one piece to the next and
    reversed on odd rounds, so load changes on a shared machine hit all paths alike. Both wall
    time and process CPU time (``time.process_time``: less sensitive to being descheduled) are kept.
    """
    names = list(paths)
    for _ in range(warmup):
        for n in names:
            paths[n](0)
    tm = Timings(names)
    k = 0
    for r in range(repeats):
        for n in names:
            tm.wall[n].append([0.0] * units)
            tm.cpu[n].append([0.0] * units)
        for u in range(units):
            order = names[k % len(names):] + names[:k % len(names)]
            if r % 2:
                order = order[::-1]
            k += 1
            for n in order:
                c0, t0 = time.process_time(), time.perf_counter()
                paths[n](u)
                tm.wall[n][r][u] = time.perf_counter() - t0
                tm.cpu[n][r][u] = time.process_time() - c0
    return tm


def med(xs) -> float:
    return float(statistics.median(xs))


def spread(xs) -> str:
    """``median [min-max]`` of a list of seconds, for printing."""
    return f"{med(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def matmul_gflops(n: int = 1024, reps: int = 5) -> float:
    """Median fp32 GFLOP/s of ``torch.matmul`` on ``n x n`` matrices at the current thread count."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.matmul(a, b)  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / med(ts) / 1e9


# ------------------------------------------------------------------------------------- printing
def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c:.4g}" if isinstance(c, float) else str(c)
                                            for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def summary(bench: str, text: str, **figures) -> None:
    """The one-line summary ``run_all.py`` collects (``SUMMARY[bench]: text``), plus its figures as
    JSON on a ``FIGURES[bench]:`` line for machines."""
    print(f"FIGURES[{bench}]: {json.dumps(figures, sort_keys=True)}")
    print(f"SUMMARY[{bench}]: {text}", flush=True)


# -------------------------------------------------------------------------------------- models
def _cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        p = Path(env)
        p.mkdir(parents=True, exist_ok=True)
        return p
    p = Path(tempfile.mkdtemp(prefix="darts-bench-bench-"))
    atexit.register(shutil.rmtree, p, True)
    os.environ[CACHE_ENV] = str(p)  # child processes of this script share it
    return p


def scratch_dir(prefix: str) -> Path:
    """A temp dir removed when the process exits."""
    p = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, p, True)
    return p


def corpus_texts(n: int = 3000) -> list[str]:
    """Up to ``n`` texts from the shared data dir (GSM8K train Q+A, Code Alpaca, Alpaca)."""
    from darts_bench.data import read_json_list, read_jsonl

    texts: list[str] = []
    gsm = DATA_DIR / "gsm8k" / "train.jsonl"
    if gsm.is_file():
        texts += [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in read_jsonl(gsm)[: n // 2]]
    for rel in ("code/code_alpaca_2k.json", "instruction/alpagasus_dolly_3k.json"):
        p = DATA_DIR / rel
        if p.is_file():
            recs = read_json_list(p)[: n // 4]
            texts += ["\n".join(str(r.get(k, "")) for k in ("instruction", "input", "output") if r.get(k))
                      for r in recs]
    if not texts:
        raise FileNotFoundError(f"no text found under {DATA_DIR} (set DARTS_BENCH_DATA)")
    return texts


def gsm8k_prompts(n: int) -> list[str]:
    """The first ``n`` GSM8K test questions in the task's prompt format (``Question: ...\\nAnswer:``)."""
    from darts_bench.data import read_jsonl

    recs = read_jsonl(DATA_DIR / "gsm8k" / "test.jsonl")[:n]
    return [f"Question: {r['question']}\nAnswer:" for r in recs]


def build_tiny_checkpoint(out: Path, *, hidden_size: int = 128, num_hidden_layers: int = 4,
                          intermediate_size: int = 344, num_attention_heads: int = 4, vocab_size: int = 4096,
                          seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A random-init ``LlamaForCausalLM`` with the tiny pool's tokenizer (trained here on shared
    data, or copied from ``tokenizer_from``), saved as safetensors into ``out`` (atomically)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from darts_bench.pool.tiny import _generation_config, train_tokenizer

    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if tokenizer_from is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
    else:
        tok = train_tokenizer(corpus_texts(), vocab_size)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_attention_heads, max_position_embeddings=1024, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = _generation_config(tok)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return out


def random_checkpoint(config_dir: Path, root: Path, seed: int = 0) -> Path:
    """A random-init model of ``config_dir``'s ``config.json`` (architecture, shapes, tied
    embeddings) with its tokenizer, saved as safetensors (atomically) into
    ``root/random-<dir name>-<config.json's hash>`` (a changed config: a new model) and returned; the
    weights in ``config_dir`` are never read (it may hold none). For timing a model's shape where its
    weights cannot travel (a device machine with no hub): the outputs of such a model mean nothing.

    Raises:
        SystemExit: ``config_dir`` has no ``config.json``.
    """
    import hashlib

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg_file = Path(config_dir) / "config.json"
    if not cfg_file.is_file():
        raise SystemExit(f"--random-from {config_dir}: no config.json there")
    tag = hashlib.sha256(cfg_file.read_bytes()).hexdigest()[:12]
    out = Path(root) / f"random-{Path(config_dir).resolve().name}-{tag}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)  # a dir left without config.json by a killed run
    cfg = AutoConfig.from_pretrained(str(config_dir))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(config_dir)).save_pretrained(tmp)
    tmp.replace(out)
    return out


def model_dir(args) -> Path:
    """The checkpoint under test: a random-init model of ``--random-from``'s config (scripts that
    offer it), ``--model-dir``, or the cached random tiny Llama."""
    if getattr(args, "random_from", None) is not None:
        t0 = time.perf_counter()
        if args.model_dir is not None:
            raise SystemExit("--random-from and --model-dir: give one")
        src = Path(args.random_from)
        p = random_checkpoint(src, _cache_root())
        print(f"random-init checkpoint of {src}'s config: {p} ({time.perf_counter() - t0:.1f} s to build or find)")
        return p
    if args.model_dir is not None:
        if not (Path(args.model_dir) / "config.json").is_file():
            raise SystemExit(f"--model-dir {args.model_dir}: no config.json there")
        return Path(args.model_dir)
    if args.tier != "tiny":
        raise SystemExit(f"--tier {args.tier} needs --model-dir (a checkpoint dir of that model)")
    t0 = time.perf_counter()
    p = build_tiny_checkpoint(_cache_root() / "tiny-llama-h128-l4-v4096", **TINY_ARCH)
    print(f"tiny Llama checkpoint: {p} ({time.perf_counter() - t0:.1f} s to build or find)")
    return p


def perturbed_copy(src: Path, dst: Path, rel_scale: float = 0.02, seed: int = 1) -> Path:
    """``src``'s checkpoint with every floating tensor moved by Gaussian noise of ``rel_scale`` times
    its own std (a stand-in for a fine-tuned expert of the same base); other files copied."""
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            sd = load_file(str(f))
            for k, v in sd.items():
                if v.is_floating_point():
                    std = float(v.float().std()) if v.numel() > 1 else 1.0
                    noise = torch.randn(v.shape, generator=g, dtype=torch.float32) * (rel_scale * (std or 1.0))
                    sd[k] = (v.float() + noise).to(v.dtype)
            save_file(sd, str(tmp / f.name), metadata={"format": "pt"})
            del sd
        elif f.is_file():
            shutil.copy(f, tmp / f.name)
    tmp.replace(dst)
    return dst


def load(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """``(model, tokenizer)`` through the project's loader (left padding; fp32 on the CPU unless told)."""
    from darts_bench.evaluate.hf_model import load_causal_lm

    return load_causal_lm(path, dtype=dtype, device=device)


def token_sequences(tok, n: int, length: int, seed: int = 0, min_frac: float = 0.875) -> list[list[int]]:
    """``n`` token-id lists cut from real text, lengths drawn in ``[min_frac * length, length]`` (so
    batches are left-padded as in collection)."""
    import random

    rng = random.Random(seed)
    stream: list[int] = []
    for t in corpus_texts():
        stream += tok(t, add_special_tokens=False)["input_ids"]
        if len(stream) > n * length + 1:
            break
    out, pos = [], 0
    for _ in range(n):
        L = rng.randint(int(min_frac * length), length)
        if pos + L > len(stream):
            pos = 0
        out.append(stream[pos:pos + L])
        pos += L
    return out
