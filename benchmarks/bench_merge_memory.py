"""Merge memory: a 3-expert TIES merge through mergekit vs loading all 4 checkpoints into torch.

A base and three "experts" (the base plus 2%-of-std Gaussian noise on every tensor) are saved as
fp32 safetensors in a temp dir. By default the base is a random Llama big enough that the
weights dominate the interpreter (hidden 512, 10 layers, intermediate 2048, the tiny tokenizer's
vocab 4096: about 46M params, 185 MB); with ``--model-dir`` that checkpoint is the base.

Each measurement runs in a fresh subprocess (this same file with ``--child MODE``) that reports
its own peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, plus ``RUSAGE_CHILDREN`` should
it start any) and wall time:
  baseline   imports (torch, safetensors, transformers, mergekit, darts_bench.merge) and nothing else
  mergekit   ``darts_bench.merge.mergekit_merge.run_one_merge`` with ``merge_config_dict`` for
             TIES (density 0.2, weight 1.0, normalize), the pipeline's own merge path (inputs
             streamed: each tensor from its own short-lived mapping; output shards of an eighth of
             the merge, at least 64 MiB: ``out_shard_bytes``)
  one_shard  the same with mergekit's default output shard (5e9 bytes: a merge below 5 GB is held
             whole until it is written; the pipeline's path before ``out_shard_bytes``); same tensors
  mapped     the same with ``stream=False``: mergekit's own loaders, which keep every input file
             mapped until the process ends (the pipeline's path before streaming); same bytes out
  naive      all 4 checkpoints read into process memory at once (``safetensors.torch.load`` of
             the file bytes; ``load_file`` would mmap lazily), then TIES in torch (top-20%
             magnitude trim per expert and tensor, sign election by summed mass, disjoint mean)
             and ``save_file``: what one writes without mergekit
Peaks are reported as multiples of one model's weight bytes, raw and with the baseline
subtracted. Both merges' outputs are compared (max |diff|) as a check that the naive TIES is
the same algorithm.

    .venv/bin/python benchmarks/bench_merge_memory.py [--hidden 512 --layers 10 --intermediate 2048] [--repeats 2]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
DENSITY, WEIGHT = 0.2, 1.0
EXPERTS = ("code", "math", "instruction")


# ---------------------------------------------------------------------------------- child side
def _imports():
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from mergekit.config import MergeConfiguration  # noqa: F401
    from mergekit.merge import run_merge  # noqa: F401

    import darts_bench.merge.mergekit_merge  # noqa: F401


def naive_ties(work: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load, save_file

    def sd(d: Path) -> dict:  # eager: the tensors live in process memory (load_file would mmap lazily)
        res = {}
        for f in sorted(d.glob("*.safetensors")):
            res.update(load(f.read_bytes()))
        return res

    base = sd(work / "base")
    experts = [sd(work / e) for e in EXPERTS]  # all 4 checkpoints in memory at once
    merged = {}
    for k, b in base.items():
        if not b.is_floating_point():
            merged[k] = b
            continue
        deltas = torch.stack([e[k] - b for e in experts])  # [3, ...]
        flat = deltas.reshape(len(experts), -1)
        keep = max(1, int(DENSITY * flat.shape[1]))
        # trim: exactly the `keep` largest |delta| per expert, ties broken by argsort order as mergekit
        # does (fp32 deltas are quantised to the base weight's ulp, so equal magnitudes at the cut are
        # common: a `>= k-th value` rule keeps a few more and the outputs differ in a few dozen elements)
        mask = torch.zeros_like(flat)
        for i in range(flat.shape[0]):
            mask[i, torch.argsort(flat[i].abs(), descending=True)[:keep]] = 1
        trimmed = flat * mask * WEIGHT
        sign = torch.where(trimmed.sum(0) >= 0, 1.0, -1.0)  # elected sign (summed mass; an exact 0 elects +)
        agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
        num = (trimmed * agree).sum(0)
        den = (agree.to(flat.dtype) * WEIGHT).sum(0).clamp_min(1e-8)  # normalize by agreeing weights
        merged[k] = (b.reshape(-1) + torch.where(den > 1e-8, num / den, torch.zeros_like(num))).reshape(b.shape)
    out.mkdir(parents=True, exist_ok=True)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})


def mergekit_ties(work: Path, out: Path, stream: bool = True, out_shard_size: int | None = None) -> None:
    from darts_bench.config import MergeSpec
    from darts_bench.merge.mergekit_merge import merge_config_dict, run_one_merge
    from darts_bench.pool.build import Pool

    pool = Pool(base=work / "base", experts={e: work / e for e in EXPERTS}, key="bench")
    spec = MergeSpec(name="ties", method="ties", weight=WEIGHT, density=DENSITY, normalize=True)
    run_one_merge(merge_config_dict(spec, pool), out, seed=0, base_dir=work / "base", stream=stream,
                  out_shard_size=out_shard_size)


def state_dict(d: Path) -> dict:
    """Every tensor of the safetensors checkpoint in ``d`` (one file or shards)."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


class RssSampler:
    """Peak anonymous and file-backed resident memory of this process, sampled from
    ``/proc/self/status`` every few ms by a daemon thread (``VmHWM`` gives the exact total peak)."""

    def __init__(self, period: float = 0.005):
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0, "sum": 0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    @staticmethod
    def status() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "RssShmem", "VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
        return out

    def sample(self) -> None:
        st = self.status()
        for k in ("RssAnon", "RssFile"):
            self.peak[k] = max(self.peak[k], st.get(k, 0))
        self.peak["sum"] = max(self.peak["sum"], st.get("RssAnon", 0) + st.get("RssFile", 0))

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(period)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        self.sample()
        return dict(self.peak)


def child(mode: str, work: Path, threads: int) -> None:
    t0 = time.perf_counter()
    sampler = RssSampler()
    import torch

    torch.set_num_threads(threads)
    _imports()
    t1 = time.perf_counter()
    if mode == "mergekit":
        mergekit_ties(work, work / "out-mergekit")
    elif mode == "one_shard":
        from darts_bench.merge.mergekit_merge import MERGEKIT_OUT_SHARD_BYTES

        mergekit_ties(work, work / "out-one_shard", out_shard_size=MERGEKIT_OUT_SHARD_BYTES)
    elif mode == "mapped":
        mergekit_ties(work, work / "out-mapped", stream=False)
    elif mode == "naive":
        naive_ties(work, work / "out-naive")
    elif mode != "baseline":
        raise SystemExit(f"unknown child mode {mode}")
    t2 = time.perf_counter()
    peak = sampler.stop()
    print(json.dumps({"mode": mode, "maxrss_self_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "vmhwm_b": RssSampler.status()["VmHWM"], "peak_anon_b": peak["RssAnon"],
                      "peak_file_b": peak["RssFile"], "peak_sum_b": peak["sum"],
                      "end_b": RssSampler.status()["RssAnon"] + RssSampler.status()["RssFile"],
                      "end_anon_b": RssSampler.status()["RssAnon"],
                      "maxrss_children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                      "import_s": t1 - t0, "work_s": t2 - t1, "cpu_s": time.process_time()}))


# --------------------------------------------------------------------------------- parent side
def run_child(mode: str, work: Path, threads: int) -> dict:
    p = subprocess.run([sys.executable, str(HERE), "--child", mode, "--work", str(work), "--threads", str(threads)],
                       capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if p.returncode != 0:
        raise RuntimeError(f"child {mode} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    line = [x for x in p.stdout.splitlines() if x.startswith("{")][-1]
    r = json.loads(line)
    r["peak_b"] = max(r["maxrss_self_kb"], r["maxrss_children_kb"]) * 1024
    return r


def main() -> None:
    import common

    ap = common.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--child", default=None, help=argparse_hidden())
    ap.add_argument("--work", type=Path, default=None, help=argparse_hidden())
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.work, args.threads)
    repeats = args.repeats or common.tier(args)["merge_repeats"]
    threads = common.set_threads(args.threads)

    import torch
    from safetensors.torch import load_file

    work = common.scratch_dir("bench-merge-")
    t0 = time.perf_counter()
    if args.model_dir is not None:
        base_src = common.model_dir(args)
    else:
        tokdir = common.model_dir(args)  # the tiny tokenizer
        base_src = common.build_tiny_checkpoint(work / "base", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                                intermediate_size=args.intermediate, num_attention_heads=8,
                                                tokenizer_from=tokdir, seed=0)
    if base_src != work / "base":
        (work / "base").symlink_to(Path(base_src).resolve(), target_is_directory=True)
    for i, e in enumerate(EXPERTS):
        common.perturbed_copy(work / "base", work / e, rel_scale=0.02, seed=1 + i)
    model_bytes = sum(f.stat().st_size for f in (work / "base").glob("*.safetensors"))
    n_params = sum(v.numel() for f in (work / "base").glob("*.safetensors") for v in load_file(str(f)).values())
    print(f"checkpoints: base + {len(EXPERTS)} experts, {n_params / 1e6:.1f}M params each, "
          f"{model_bytes / 2**20:.0f} MiB safetensors each (built in {time.perf_counter() - t0:.0f} s)")

    res: dict[str, list[dict]] = {"baseline": [], "mergekit": [], "one_shard": [], "mapped": [], "naive": []}
    for r in range(repeats):
        for mode in (list(res) if r % 2 == 0 else list(res)[::-1]):
            res[mode].append(run_child(mode, work, threads))

    def pk(mode, key):  # the smallest over repeats (they barely vary; min drops a stray outlier)
        return min(x[key] for x in res[mode])

    M = model_bytes
    base_b, base_anon = pk("baseline", "end_b"), pk("baseline", "end_anon_b")
    rows = []
    for mode in res:
        p, pa, pf, hwm = pk(mode, "peak_sum_b"), pk(mode, "peak_anon_b"), pk(mode, "peak_file_b"), pk(mode, "peak_b")
        rows.append([mode, f"{p / 2**20:,.0f}", f"{(p - base_b) / M:.2f}", f"{(pa - base_anon) / M:.2f}",
                     f"{pf / 2**20:,.0f}", f"{hwm / 2**20:,.0f}", common.spread([x["work_s"] for x in res[mode]])])
    print(f"fresh subprocess per run, min over {repeats} runs; model = {M / 2**20:.0f} MiB of weights; {threads} thread(s)")
    print("peak = max of RssAnon + RssFile sampled every 5 ms after the imports; base = the baseline process's "
          "RSS once its imports are done; anon = process-private memory; file = mapped files (e.g. mmap-ed "
          "safetensors: page cache the kernel can drop); ru_maxrss also counts transient spikes during the imports")
    print(common.table(["process", "peak MiB", "(peak-base)/model", "(anon-base)/model", "file MiB", "ru_maxrss MiB",
                        "work s"], rows))

    streamed_same = all((work / "out-mapped" / f.name).read_bytes() == f.read_bytes()
                        for f in (work / "out-mergekit").glob("*.safetensors"))
    print(f"streamed vs mapped mergekit output: {'byte-identical' if streamed_same else 'DIFFERENT'} safetensors")
    a, one = state_dict(work / "out-mergekit"), state_dict(work / "out-one_shard")
    n_shards = len(list((work / "out-mergekit").glob("*.safetensors")))
    sharded_same = a.keys() == one.keys() and all(torch.equal(a[k], one[k]) for k in a)
    print(f"the pipeline's {n_shards} output shards vs one shard: {'bitwise-equal' if sharded_same else 'DIFFERENT'} "
          "tensors")
    b = load_file(str(work / "out-naive" / "model.safetensors"))
    common_keys = [k for k in a if k in b]
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in common_keys)
    n_diff = sum(int(((a[k].float() - b[k].float()).abs() > 1e-6).sum()) for k in common_keys)
    n_all = sum(a[k].numel() for k in common_keys)
    base_sd = state_dict(work / "base")
    moved = max(float((b[k].float() - base_sd[k].float()).abs().max()) for k in common_keys)
    print(f"mergekit vs naive TIES output: {len(common_keys)} common tensors, max |diff| {diff:.2e} "
          f"(merge moves weights by up to {moved:.2e}); {n_diff} of {n_all} elements differ by > 1e-6")

    mka, nva = (pk("mergekit", "peak_anon_b") - base_anon) / M, (pk("naive", "peak_anon_b") - base_anon) / M
    mk, nv = (pk("mergekit", "peak_sum_b") - base_b) / M, (pk("naive", "peak_sum_b") - base_b) / M
    mpa, mp = (pk("mapped", "peak_anon_b") - base_anon) / M, (pk("mapped", "peak_sum_b") - base_b) / M
    osa, os_ = (pk("one_shard", "peak_anon_b") - base_anon) / M, (pk("one_shard", "peak_sum_b") - base_b) / M
    t_ratio = common.med([x["work_s"] for x in res["mergekit"]]) / common.med([x["work_s"] for x in res["naive"]])
    t_stream = common.med([x["work_s"] for x in res["mergekit"]]) / common.med([x["work_s"] for x in res["mapped"]])
    t_shards = common.med([x["work_s"] for x in res["mergekit"]]) / common.med([x["work_s"] for x in res["one_shard"]])
    print(f"streamed vs mapped mergekit: {mp / mk:.1f}x less total memory ({mp:.2f}x -> {mk:.2f}x a model), "
          f"time ratio streamed/mapped {t_stream:.2f}")
    print(f"{n_shards} output shards vs one: {os_ / mk:.2f}x less total memory ({os_:.2f}x -> {mk:.2f}x a model; "
          f"anonymous {osa:.2f}x -> {mka:.2f}x), time ratio {t_shards:.2f}")
    print(f"import baseline: {base_b / 2**20:,.0f} MiB RSS after the imports ({base_anon / 2**20:,.0f} MiB anonymous), "
          f"{pk('baseline', 'peak_b') / 2**20:,.0f} MiB ru_maxrss (a transient during the imports)")
    print(f"mergekit vs naive: {nv / mk:.1f}x less total and {nva / mka:.1f}x less anonymous memory with mergekit "
          f"(mergekit reads inputs through mmap: its file-backed pages are reclaimable)")
    common.summary(
        "merge_memory",
        f"peak RSS above the import baseline, in model sizes: mergekit {mk:.2f}x ({n_shards} output shards; one shard "
        f"{os_:.2f}x; mapped inputs {mp:.2f}x) vs naive "
        f"all-4-in-torch {nv:.2f}x "
        f"(anonymous only: {mka:.2f}x vs {nva:.2f}x); baseline {base_b / 2**20:,.0f} MiB, model {M / 2**20:,.0f} MiB; "
        f"mergekit/naive time {t_ratio:.2f}; outputs max |diff| {diff:.1e}",
        mergekit_over_model=mk, naive_over_model=nv, mergekit_anon_over_model=mka, naive_anon_over_model=nva,
        mapped_over_model=mp, mapped_anon_over_model=mpa, time_ratio_streamed_mapped=t_stream,
        streamed_identical=streamed_same, one_shard_over_model=os_, one_shard_anon_over_model=osa,
        out_shards=n_shards, sharded_identical=sharded_same, time_ratio_shards_one=t_shards,
        baseline_mib=base_b / 2**20, model_mib=M / 2**20, time_ratio_mergekit_naive=t_ratio, max_abs_diff=diff)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.path.insert(0, str(HERE.parent.parent))
    main()
