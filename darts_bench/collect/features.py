"""Calibration sequences and cached hidden-state features.

For each task and calibration split (``transductive``: the benchmark's own inputs, as in the
Surgery paper, by default its first ``calibration.n_prompts`` inputs whether evaluated or not,
prompts only; ``inductive``: prompts from the expert's training data):

1. the prompts, formatted exactly as at evaluation (chat template where the task uses one), each
   continued by the task expert's greedy generation (``calibration.max_new_tokens`` at most), so
   the loss covers the positions where generation happens;
2. the expert's final hidden state (after the last norm, stored in the model's dtype: bf16 at
   scale, float32 on the tiny tier; the dtype is recorded in ``index.json``) and next-token
   entropy (nats, fp32) at every token — one artifact per (task, split), shared by all merges;
3. each merged model's final hidden state and entropy on the same tokens — one artifact per
   (merge, task, split).

Features are computed in forward batches of ``ray.shard_size`` sequences grouped by length
(:data:`BATCHING`: little padding), each batch persisted as it finishes so a resumed run redoes only
missing ones, and stored in the layout of :mod:`darts_bench.collect.store` (safetensors shards of
``ray.shard_size`` sequences in the set's fixed order, an ``index.json``). NaN/inf features fail the
run, naming the shard (forward batch) and its sequences.
Readers never concatenate a whole artifact: :class:`~darts_bench.collect.store.ShardedFeatures`
reads it shard by shard.

The continuations come from the calibration backend (``calibration.backend``, passed in as an
open :class:`~darts_bench.evaluate.engines.Backend`), the features from the executor; both are
handed in, so this module imports neither ``evaluate`` nor ``executors`` (no import circle with
them: ``tests/test_import_graph.py``).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from darts_bench.api import Task
from darts_bench.artifacts import cached, stable_hash
from darts_bench.collect import store
from darts_bench.collect.store import ShardedFeatures, load_shards
from darts_bench.rows import merged_entropy_needed

log = logging.getLogger("darts_bench")


#: how sequences are grouped into forward batches (in :func:`numerics_key`: the grouping changes the
#: padding, hence the values): ``by_length`` = sorted by token count (stable), so a batch pads little
#: (the smollm2-135m calibration sets: 81,552 padded positions for 62,785 tokens in stored order,
#: 67,344 sorted)
BATCHING = "by_length"


def length_order(sequences: list[list[int]]) -> list[int]:
    """Indices of ``sequences`` sorted by length (stable: equal lengths keep their order)."""
    return sorted(range(len(sequences)), key=lambda i: len(sequences[i]))


def _run_sharded(executor, model_dir: Path, sequences: list[list[int]], shard_size: int, out: Path,
                 partial: Path, prefix: str, desc: str, entropy: bool = True) -> None:
    """Compute features in batches of ``shard_size`` length-sorted sequences (:func:`length_order`;
    each batch persisted in ``partial`` as it finishes, so a resumed run redoes only missing ones),
    then write them into ``out`` in the store's layout (:mod:`darts_bench.collect.store`: shards of
    ``shard_size`` sequences in stored order, an index), one shard in memory at a time. ``entropy``
    False: no next-token entropy column (:func:`~darts_bench.executors.worker.hidden_state_features`).

    Raises:
        FloatingPointError: a batch holds NaN/inf (named by its shard index, ``desc`` and its sequences).
    """
    order = length_order(sequences)
    batches = [order[i:i + shard_size] for i in range(0, len(order), shard_size)]
    payloads = [{"sequences": [sequences[j] for j in b], **({} if entropy else {"entropy": False})} for b in batches]
    partial.mkdir(parents=True, exist_ok=True)
    bname = f"batch-{prefix}"
    done = {i for i in range(len(payloads)) if store.shard_is_complete(partial / store.shard_name(bname, i))}

    def persist(i: int, res: dict) -> None:
        feats = store.decode_features(res)
        feats["seq_index"] = torch.tensor(batches[i], dtype=torch.long)[feats["seq_index"]]  # batch -> stored index
        store.check_finite(feats, f"shard {i} of {desc} (sequences {batches[i]})")
        store.write_shard(partial, bname, i, feats)

    if done:
        log.info("%s: resuming, %d/%d batches already done", desc, len(done), len(payloads))
    executor.map(str(model_dir), "features", payloads, skip=done, on_result=persist, desc=desc)
    names = store.regroup(partial, [store.shard_name(bname, i) for i in range(len(payloads))], out, prefix,
                          len(sequences), shard_size)
    store.write_index(out, names, len(sequences))
    shutil.rmtree(partial, ignore_errors=True)


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


def calibration_prompts(task: Task, split: str, cfg, text_model, inputs: list[str]) -> list[str]:
    """Prompts of one split: ``transductive`` = the first ``n_prompts`` of ``inputs``, the benchmark
    prompts of :func:`darts_bench.stages.tasks.calibration_inputs` (fewer when there are fewer, with a
    warning); ``inductive`` = ``n_prompts`` prompts sampled from the expert's training data.

    Raises:
        ValueError: fewer than 2 prompts."""
    cal = cfg.calibration
    n = cal.n_prompts
    if split == "transductive":
        prompts = list(inputs[:n])
        if len(prompts) < n:
            what = "the evaluated inputs" if cal.transductive_inputs == "evaluated" else "the benchmark's inputs"
            log.warning("calibration %s/transductive: %d prompts (%s), not calibration.n_prompts %d; %s",
                        task.name, len(prompts), what, n,
                        f"raise tasks.{task.name}.limit or set calibration.transductive_inputs=benchmark"
                        if cal.transductive_inputs == "evaluated" else "the benchmark has no more")
    else:
        prompts = task.training_prompts(cfg.resolved_data_dir(), text_model, n, cfg.seed)
    if len(prompts) < 2:
        raise ValueError(f"calibration set of {task.name}/{split} has {len(prompts)} prompts; need >= 2")
    return prompts


def numerics_key(cfg) -> dict[str, Any]:
    """The settings besides the model and the tokens that change feature values: the device (CPU
    and GPU kernels round differently) and the batch size (sequences are left-padded to the
    longest in their batch, and batched kernels reduce in a shape-dependent order), how sequences
    are grouped into batches (:data:`BATCHING`), and ``pool.dtype`` (features are computed and stored in the model's dtype; also in the pool key for
    ``hf`` pools, here for every pool kind). ``ray.shard_size`` is in the calibration key (shards
    are batched separately)."""
    return {"device": cfg.device, "batch_size": cfg.calibration.batch_size, "dtype": cfg.pool.dtype,
            "batching": BATCHING}


def calibration_key(cfg, task: Task, split: str, prompts: list[str], expert_key: str,
                    references: list[str] | None = None, *, engine_key: dict[str, Any]) -> str:
    """Cache key of a calibration set: expert model key, task (name, version), split, prompts,
    references, token caps, shard size, :func:`numerics_key` and ``engine_key``, the generation
    backend's part (``Backend.key`` of the calibration backend,
    :func:`darts_bench.evaluate.engines.backend_key` ``(cfg, "calibration")``: empty for ``hf``, so
    HF keys are unchanged by it)."""
    cal = cfg.calibration
    return stable_hash({"expert": expert_key, "task": task.name, "version": task.version, "split": split,
                        "prompts": stable_hash(prompts), "refs": stable_hash(references), "max_new": cal.max_new_tokens,
                        "max_prompt": cal.max_prompt_tokens, "shard": cfg.ray.shard_size,
                        "numerics": numerics_key(cfg), **engine_key})


def merged_key(cfg, merge_key: str, calib_key: str) -> str:
    """Cache key of a merged model's features on a calibration set (includes :func:`numerics_key`);
    features without the entropy column (:func:`merged_entropy_needed` False) are keyed apart, the
    others as before the column became optional."""
    key = {"merge": merge_key, "calib": calib_key, "numerics": numerics_key(cfg)}
    if not merged_entropy_needed(cfg):
        key["entropy"] = False
    return stable_hash(key)


def collect_calibration(cfg, task: Task, split: str, prompts: list[str], expert_dir: Path, executor,
                        tokenizer, work_dir: Path, expert_key: str,
                        references: list[str] | None = None, *, backend) -> CalibrationSet:
    """Expert continuations and expert features for one (task, split); cached.

    ``backend``: the run's calibration backend (:func:`darts_bench.evaluate.engines.open_models`
    with ``role="calibration"``, kept open across calls so an engine serves every split of an
    expert): it makes the expert's greedy continuations (``Backend.continuations``) and names its
    engine in the cache key (``Backend.key``). The features always come from ``executor`` (HF).

    With ``references`` (split ``reference``) each prompt is continued by its reference answer
    (at most ``max_prompt_tokens`` tokens) instead of the expert's generation: these sequences
    are for evaluation signals only, never for training.
    """
    cal = cfg.calibration
    key = calibration_key(cfg, task, split, prompts, expert_key, references, engine_key=backend.key)
    final = work_dir / "calibration" / f"{task.name}-{split}-{key}"

    def build(tmp: Path) -> None:
        tokenizer.truncation_side = "left"
        prompt_ids = [tokenizer(p, add_special_tokens=True, truncation=True,
                                max_length=cal.max_prompt_tokens)["input_ids"] for p in prompts]
        if references is not None:
            gen_ids = [tokenizer(r, add_special_tokens=False)["input_ids"][:cal.max_prompt_tokens]
                       for r in references]
        else:  # the expert's greedy continuation of exactly these (truncated) prompt tokens
            gen_ids = backend.continuations(task.expert, expert_dir, prompt_ids, cal.max_new_tokens,
                                            desc=f"calibrate {task.name}/{split}")
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

    spec = next((s for s in cfg.merges if s.name == merge), None)
    drift = spec.planted_drift if spec is not None else None

    def build(tmp: Path) -> None:
        seqs = calib.meta["sequences"]
        _run_sharded(executor, merge_dir, seqs, cfg.ray.shard_size, tmp, final.with_name(final.name + ".partial"),
                     "merged", f"merged features {merge}/{calib.task}/{calib.split}",
                     entropy=merged_entropy_needed(cfg))
        if drift:
            plant_drift(tmp, merge_dir, drift, cfg.seed)

    cached(final, build, what=f"collect features {merge}/{calib.task}/{calib.split}",
           meta={"kind": "features", "merge": merge, "calib": calib.key})
    return FeatureSet(merge=merge, calib=calib, root=final, key=key)


#: positions the planted drift covers (0 .. PLANTED_POSITIONS - 1; zero beyond): the calibration range of the
#: tiers that run the positive control
PLANTED_POSITIONS = 512


def planted_drift_table(d_model: int, scale: float, seed: int, n_positions: int = PLANTED_POSITIONS) -> torch.Tensor:
    """``[n_positions, d_model]`` float32: the positive control's drift, one fixed random direction per
    absolute position (standard normal, seeded), each row scaled to norm ``scale``, then the mean over
    positions subtracted (so the drift averages to zero over positions: a constant, position-agnostic
    offset cannot remove it, and its rank is ~``n_positions``, beyond a rank-16 head)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n_positions, d_model, generator=g, dtype=torch.float64)
    r = r / r.norm(dim=1, keepdim=True) * scale
    return (r - r.mean(dim=0, keepdim=True)).float()


def _checkpoint_tensor(model_dir: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint dir (single file or shards), read memory-mapped.

    Raises:
        KeyError: no shard holds ``name``.
    """
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if name in sf.keys():
                return sf.get_tensor(name)
    raise KeyError(f"{model_dir}: no tensor {name!r} in its safetensors files")


def plant_drift(folder: Path, merge_dir: Path, amount: float, seed: int) -> None:
    """Add the planted drift to every ``h`` of the merged features in ``folder`` (shards rewritten
    atomically), at each token's absolute position: ``h[t] += D[pos[t]]`` with ``D`` from
    :func:`planted_drift_table`, scaled to ``amount`` times the final hidden state's typical norm
    ``sqrt(d) * rms(model.norm.weight)`` (the final RMSNorm's output has unit RMS before its weight).

    Raises:
        KeyError: the checkpoint has no ``model.norm.weight`` (not a Llama-style decoder).
    """
    w = _checkpoint_tensor(merge_dir, "model.norm.weight").float()
    d = w.numel()
    table = planted_drift_table(d, float(amount * math.sqrt(d) * w.pow(2).mean().sqrt()), seed)
    for path in sorted(folder.glob("merged-*.safetensors")):
        feats = store.load_file(str(path))
        pos = feats["positions"].clamp(max=PLANTED_POSITIONS - 1)
        inside = (feats["positions"] < PLANTED_POSITIONS).to(feats["h"].dtype).unsqueeze(-1)
        feats["h"] = (feats["h"].float() + table[pos] * inside).to(feats["h"].dtype)
        i = int(path.stem.rsplit("-", 1)[1])
        store.write_shard(folder, "merged", i, feats)
