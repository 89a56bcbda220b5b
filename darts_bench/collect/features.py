"""Calibration sequences and cached hidden-state features.

For each task and calibration split (``transductive``: the benchmark's own inputs, as in the
Surgery paper; ``inductive``: prompts from the expert's training data):

1. the prompts, formatted exactly as at evaluation (chat template where the task uses one), each
   continued by the task expert's greedy generation (``calibration.max_new_tokens`` at most), so
   the loss covers the positions where generation happens;
2. the expert's final hidden state (after the last norm, stored in the model's dtype: bf16 at
   scale, float32 on the tiny tier; the dtype is recorded in ``index.json``) and next-token
   entropy (nats, fp32) at every token — one artifact per (task, split), shared by all merges;
3. each merged model's final hidden state and entropy on the same tokens — one artifact per
   (merge, task, split).

Features are stored as safetensors shards (fixed-order shards of ``ray.shard_size`` sequences)
with an ``index.json`` (shard names, tokens per shard, feature dtype); shards are persisted as they
finish so a resumed run redoes only missing shards. NaN/inf features fail the run, naming the shard.
Readers never concatenate a whole artifact: :class:`ShardedFeatures` reads it shard by shard
through safetensors' memory-mapped ``safe_open`` (into one preallocated buffer, or as a stream of
token batches).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from darts_bench.api import Task
from darts_bench.artifacts import cached, stable_hash
from darts_bench.evaluate.backends import backend_key

log = logging.getLogger("darts_bench")


def _shard_payloads(sequences: list[list[int]], shard_size: int) -> list[dict[str, Any]]:
    return [{"sequences": sequences[i:i + shard_size]} for i in range(0, len(sequences), shard_size)]


def _check_finite(feats: dict[str, torch.Tensor], where: str) -> None:
    for k, v in feats.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            n = int((~torch.isfinite(v)).sum())
            raise FloatingPointError(f"{n} non-finite values in {k} of {where}; the model produced NaN/inf "
                                     "(check the checkpoint and dtype)")


def _run_sharded(executor, model_dir: Path, sequences: list[list[int]], shard_size: int, out: Path,
                 partial: Path, prefix: str, desc: str) -> None:
    """Compute features shard by shard (persisted in ``partial`` as they finish), then move the
    shards into ``out`` with an index."""
    payloads = _shard_payloads(sequences, shard_size)
    partial.mkdir(parents=True, exist_ok=True)
    done = set()
    for i in range(len(payloads)):
        p = partial / f"{prefix}-{i:05d}.safetensors"
        if p.is_file():
            try:
                load_file(str(p))
                done.add(i)
            except Exception:  # a torn shard from a killed run: redo it
                p.unlink()

    def persist(i: int, res: dict) -> None:
        feats = decode_features(res)
        feats["seq_index"] = feats["seq_index"] + i * shard_size
        _check_finite(feats, f"shard {i} of {desc}")
        tmp = partial / f".tmp-{prefix}-{i:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in feats.items()}, str(tmp))
        tmp.replace(partial / f"{prefix}-{i:05d}.safetensors")

    if done:
        log.info("%s: resuming, %d/%d shards already done", desc, len(done), len(payloads))
    executor.map(str(model_dir), "features", payloads, skip=done, on_result=persist, desc=desc)
    index = {"shards": [], "n_sequences": len(sequences), "n_tokens": [], "dtype": None}
    for i in range(len(payloads)):
        name = f"{prefix}-{i:05d}.safetensors"
        (partial / name).replace(out / name)
        index["shards"].append(name)
        with safe_open(str(out / name), "pt") as st:
            sl = st.get_slice("h")
            index["n_tokens"].append(int(sl.get_shape()[0]))
            index["dtype"] = _ST_DTYPES[sl.get_dtype()]
    (out / "index.json").write_text(json.dumps(index))
    shutil.rmtree(partial, ignore_errors=True)


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64"}


def encode_features(feats: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Features as numpy arrays for the trip from a worker (numpy has no bfloat16: a bf16 tensor
    travels as its int16 bit pattern, its dtype named under ``"dtypes"``). Inverse:
    :func:`decode_features`."""
    out: dict[str, Any] = {"dtypes": {}}
    for k, v in feats.items():
        if v.dtype == torch.bfloat16:
            out["dtypes"][k] = "bfloat16"
            v = v.view(torch.int16)
        out[k] = v.numpy()
    return out


def decode_features(res: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors from :func:`encode_features`' output (bit-exact)."""
    dtypes = res.get("dtypes", {})
    out = {}
    for k, v in res.items():
        if k == "dtypes":
            continue
        t = torch.from_numpy(np.asarray(v))
        out[k] = t.view(getattr(torch, dtypes[k])) if k in dtypes else t
    return out


def load_shards(root: Path) -> dict[str, torch.Tensor]:
    """Concatenate the shards listed in ``root/index.json`` (tokens in sequence order).

    Holds every shard and the concatenation at once (about twice the artifact): small artifacts
    and tests only; the pipeline reads through :class:`ShardedFeatures`."""
    index = json.loads((root / "index.json").read_text())
    parts = [load_file(str(root / s)) for s in index["shards"]]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class ShardedFeatures:
    """Read-only access to one feature artifact (``index.json`` + safetensors shards) without
    concatenating it: each shard is opened memory-mapped with ``safetensors.safe_open``.

    Columns: ``h`` ``[N, d]`` in the stored dtype (the model's), ``entropy`` ``[N]`` float32
    (nats), ``positions`` / ``seq_index`` ``[N]`` int64; N = tokens over all shards, in sequence order.

    Raises:
        FileNotFoundError: no ``index.json`` or a listed shard is missing.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        f = self.root / "index.json"
        if not f.is_file():
            raise FileNotFoundError(f"feature index missing: {f}")
        index = json.loads(f.read_text())
        self.files = [self.root / s for s in index["shards"]]
        lengths, dtype, d = [], None, None
        for p in self.files:
            if not p.is_file():
                raise FileNotFoundError(f"feature shard missing: {p} (listed in {f})")
            with safe_open(str(p), "pt") as st:
                sl = st.get_slice("h")
                shape = sl.get_shape()
                lengths.append(int(shape[0]))
                dtype, d = _ST_DTYPES[sl.get_dtype()], int(shape[1])
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.dtype, self.d = index.get("dtype") or dtype, d

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def column(self, key: str) -> torch.Tensor:
        """A 1-D column (``entropy``, ``positions``, ``seq_index``) for all tokens (small: ``[N]``)."""
        parts = []
        for p in self.files:
            with safe_open(str(p), "pt") as st:
                parts.append(st.get_tensor(key))
        return torch.cat(parts)

    def read_h(self) -> torch.Tensor:
        """``h`` for all tokens, ``[N, d]`` in the stored dtype, filled shard by shard into one
        preallocated tensor (peak: the tensor + one shard)."""
        out = torch.empty((len(self), self.d), dtype=getattr(torch, self.dtype))
        for p, o, n in zip(self.files, self.offsets, self.lengths):
            with safe_open(str(p), "pt") as st:
                out[o:o + n] = st.get_tensor("h")
        return out

    def shards(self, keys: tuple[str, ...] = ("h", "entropy", "positions", "seq_index")):
        """Yield ``(offset, {key: tensor})`` per shard, one shard in memory at a time."""
        for p, o in zip(self.files, self.offsets):
            with safe_open(str(p), "pt") as st:
                yield int(o), {k: st.get_tensor(k) for k in keys}


@dataclass
class CalibrationSet:
    """Calibration sequences of one (task, split) and the expert's features on them."""

    task: str
    split: str
    root: Path
    key: str

    @cached_property
    def meta(self) -> dict:
        """``sequences.json``: prompts, prompt lengths and token sequences (read once)."""
        return json.loads((self.root / "sequences.json").read_text())

    def expert_features(self) -> dict[str, torch.Tensor]:
        """All expert features concatenated (see :func:`load_shards`; small sets only)."""
        return load_shards(self.root)

    def expert_shards(self) -> "ShardedFeatures":
        """The expert features, read shard by shard (:class:`ShardedFeatures`)."""
        return ShardedFeatures(self.root)


@dataclass
class FeatureSet:
    """A merged model's features on a calibration set (tokens aligned with the expert's)."""

    merge: str
    calib: CalibrationSet
    root: Path
    key: str

    def merged_features(self) -> dict[str, torch.Tensor]:
        """All merged features concatenated (see :func:`load_shards`; small sets only)."""
        return load_shards(self.root)

    def merged_shards(self) -> "ShardedFeatures":
        """The merged features, read shard by shard (:class:`ShardedFeatures`)."""
        return ShardedFeatures(self.root)


def calibration_prompts(task: Task, split: str, cfg, text_model, examples) -> list[str]:
    """Prompts of one split: ``transductive`` = the first ``n_prompts`` evaluated benchmark inputs
    (fewer when the task's limit is smaller, with a warning); ``inductive`` = ``n_prompts`` prompts
    sampled from the expert's training data.

    Raises:
        ValueError: fewer than 2 prompts."""
    n = cfg.calibration.n_prompts
    if split == "transductive":
        prompts = [e.prompt for e in examples[:n]]
        if len(prompts) < n:
            log.warning("calibration %s/transductive: %d prompts (the evaluated inputs), not calibration.n_prompts "
                        "%d; raise tasks.%s.limit for more", task.name, len(prompts), n, task.name)
    else:
        prompts = task.training_prompts(cfg.resolved_data_dir(), text_model, n, cfg.seed)
    if len(prompts) < 2:
        raise ValueError(f"calibration set of {task.name}/{split} has {len(prompts)} prompts; need >= 2")
    return prompts


def numerics_key(cfg) -> dict[str, Any]:
    """The settings besides the model and the tokens that change feature values: the device (CPU
    and GPU kernels round differently) and the batch size (sequences are left-padded to the
    longest in their batch, and batched kernels reduce in a shape-dependent order), and
    ``pool.dtype`` (features are computed and stored in the model's dtype; also in the pool key for
    ``hf`` pools, here for every pool kind). ``ray.shard_size`` is in the calibration key (shards
    are batched separately)."""
    return {"device": cfg.device, "batch_size": cfg.calibration.batch_size, "dtype": cfg.pool.dtype}


def calibration_key(cfg, task: Task, split: str, prompts: list[str], expert_key: str,
                    references: list[str] | None = None) -> str:
    """Cache key of a calibration set: expert model key, task (name, version), split, prompts,
    references, token caps, shard size, :func:`numerics_key` and the generation backend (empty for
    ``hf``, so HF keys are unchanged by it)."""
    cal = cfg.calibration
    return stable_hash({"expert": expert_key, "task": task.name, "version": task.version, "split": split,
                        "prompts": stable_hash(prompts), "refs": stable_hash(references), "max_new": cal.max_new_tokens,
                        "max_prompt": cal.max_prompt_tokens, "shard": cfg.ray.shard_size,
                        "numerics": numerics_key(cfg), **backend_key(cal.backend, cfg.evaluate.vllm, cfg.pool.dtype)})


def merged_key(cfg, merge_key: str, calib_key: str) -> str:
    """Cache key of a merged model's features on a calibration set (includes :func:`numerics_key`)."""
    return stable_hash({"merge": merge_key, "calib": calib_key, "numerics": numerics_key(cfg)})


def collect_calibration(cfg, task: Task, split: str, prompts: list[str], expert_dir: Path, executor,
                        tokenizer, work_dir: Path, expert_key: str,
                        references: list[str] | None = None) -> CalibrationSet:
    """Expert continuations and expert features for one (task, split); cached.

    With ``references`` (split ``reference``) each prompt is continued by its reference answer
    (at most ``max_prompt_tokens`` tokens) instead of the expert's generation: these sequences
    are for evaluation signals only, never for training.
    """
    cal = cfg.calibration
    key = calibration_key(cfg, task, split, prompts, expert_key, references)
    final = work_dir / "calibration" / f"{task.name}-{split}-{key}"

    def build(tmp: Path) -> None:
        tokenizer.truncation_side = "left"
        prompt_ids = [tokenizer(p, add_special_tokens=True, truncation=True,
                                max_length=cal.max_prompt_tokens)["input_ids"] for p in prompts]
        if references is not None:
            gen_ids = [tokenizer(r, add_special_tokens=False)["input_ids"][:cal.max_prompt_tokens]
                       for r in references]
        elif cal.backend == "vllm":  # the same continuation from the expert's vLLM engine
            from darts_bench.evaluate.backends.vllm import engine_for

            eng = engine_for(expert_dir, cfg.evaluate.vllm, cfg.pool.dtype, seed=cfg.seed)
            gens = eng.text_model(task.expert).generate_ids(prompt_ids, max_new_tokens=cal.max_new_tokens)
            gen_ids = [s[0] for s in gens]
        else:  # the expert's greedy continuation of exactly these (truncated) prompt tokens
            gen_payloads = [{"prompts": prompt_ids[i:i + cfg.ray.shard_size],
                             "kwargs": {"max_new_tokens": cal.max_new_tokens}}
                            for i in range(0, len(prompt_ids), cfg.ray.shard_size)]
            gens = executor.map(str(expert_dir), "generate_ids", gen_payloads,
                                desc=f"calibrate {task.name}/{split}")
            gen_ids = [s[0] for shard in gens for s in shard]
        sequences = [p + g for p, g in zip(prompt_ids, gen_ids)]
        (tmp / "sequences.json").write_text(json.dumps({
            "task": task.name, "split": split, "prompts": prompts, "prompt_len": [len(p) for p in prompt_ids],
            "sequences": sequences}))
        _run_sharded(executor, expert_dir, sequences, cfg.ray.shard_size, tmp, final.with_name(final.name + ".partial"),
                     "expert", f"expert features {task.name}/{split}")

    cached(final, build, what=f"collect calibration {task.name}/{split}",
           meta={"kind": "calibration", "task": task.name, "split": split})
    return CalibrationSet(task=task.name, split=split, root=final, key=key)


def collect_merged(cfg, merge: str, merge_dir: Path, merge_key: str, calib: CalibrationSet, executor,
                   work_dir: Path) -> FeatureSet:
    """The merged model's features on ``calib``'s sequences; cached per (merge, calibration set)."""
    key = merged_key(cfg, merge_key, calib.key)
    final = work_dir / "features" / f"{merge}-{calib.task}-{calib.split}-{key}"

    def build(tmp: Path) -> None:
        seqs = calib.meta["sequences"]
        _run_sharded(executor, merge_dir, seqs, cfg.ray.shard_size, tmp, final.with_name(final.name + ".partial"),
                     "merged", f"merged features {merge}/{calib.task}/{calib.split}")

    cached(final, build, what=f"collect features {merge}/{calib.task}/{calib.split}",
           meta={"kind": "features", "merge": merge, "calib": calib.key})
    return FeatureSet(merge=merge, calib=calib, root=final, key=key)
