"""What the data merges (AdaMerging, RegMean) share: their prompts, batches, and the checkpoint they write.

The data are the run's calibration prompts, inputs only: for each task with an expert, the
prompts of ``spec.calibration_split`` exactly as the collect stage draws them
(:func:`darts_bench.collect.features.calibration_prompts`; transductive ones are the benchmark
inputs of :func:`darts_bench.stages.tasks.calibration_inputs`, never their references), tokenised
as collection does (the base's tokenizer, special tokens added, left-truncated to
``calibration.max_prompt_tokens``). No expert continuation and no reference answer is read. All of a
split's prompts are used, also those the heads hold out (the held-out split is drawn per head seed,
after the merge), so a data merge's held-out behaviour signals are on inputs its merge has seen.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from darts_bench.artifacts import stable_hash


def prompts_by_task(cfg, loaded, split: str) -> dict[str, tuple[str, list[str]]]:
    """``{task: (expert, prompts)}`` for every loaded task with an expert: the calibration prompts of
    ``split`` (:func:`darts_bench.collect.features.calibration_prompts`), in the run's order.

    Raises:
        ValueError: no loaded task has an expert, or a split yields fewer than 2 prompts."""
    from darts_bench.collect.features import calibration_prompts

    out = {}
    for name, (task, _) in loaded.tasks.items():
        if task.expert is None:
            continue
        out[name] = (task.expert, calibration_prompts(task, split, cfg, loaded.formatter,
                                                      loaded.calibration_inputs.get(name, [])))
    if not out:
        raise ValueError(f"the data merges need calibration prompts, but none of the tasks {list(loaded.tasks)} "
                         "has an expert")
    return out


def data_key(prompts: dict[str, tuple[str, list[str]]], cfg) -> dict:
    """The part of a data merge's cache key that its data make: the prompts (per task and expert) and
    the tokenisation cap and device (CPU and GPU kernels round differently)."""
    return {"prompts": stable_hash({t: [e, p] for t, (e, p) in sorted(prompts.items())}),
            "max_prompt_tokens": cfg.calibration.max_prompt_tokens, "device": cfg.device}


def prompt_batches(tokenizer, prompts: list[str], batch_size: int, max_tokens: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(input_ids [B, T] int64, attention_mask [B, T] int64)]``, ``batch_size`` prompts each in the
    given order, right-padded (positions of real tokens start at 0), each prompt tokenised with
    special tokens and left-truncated to ``max_tokens`` as collection does."""
    tokenizer.truncation_side = "left"
    ids = [tokenizer(p, add_special_tokens=True, truncation=True, max_length=max_tokens)["input_ids"]
           for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return right_padded(ids, batch_size, pad)


def right_padded(seqs: list[list[int]], batch_size: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(input_ids [B, T] int64, attention_mask [B, T] int64)]``: ``seqs`` (token ids) in order,
    ``batch_size`` a batch, right-padded with ``pad`` to the batch's longest (T)."""
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i:i + batch_size]
        T = max(len(x) for x in chunk)
        inp = torch.full((len(chunk), T), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.long)
        for j, x in enumerate(chunk):
            inp[j, :len(x)] = torch.tensor(x, dtype=torch.long)
            mask[j, :len(x)] = 1
        out.append((inp, mask))
    return out


def load_model(path: Path, device: str):
    """A checkpoint as ``AutoModelForCausalLM`` in fp32 on ``device``, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def copy_base_files(base_dir: Path, out: Path) -> None:
    """Carry the base's generation config, eos ids and chat template into a merge dir (as every merge).

    Raises:
        RuntimeError: ``out`` has no safetensors weights."""
    if not any(out.glob("*.safetensors")):
        raise RuntimeError(f"no safetensors written into {out}")
    gen = base_dir / "generation_config.json"
    if gen.is_file():
        shutil.copy(gen, out / "generation_config.json")
    base_cfg = json.loads((base_dir / "config.json").read_text())
    merged_cfg = json.loads((out / "config.json").read_text())
    if merged_cfg.get("eos_token_id") != base_cfg.get("eos_token_id"):
        merged_cfg["eos_token_id"] = base_cfg.get("eos_token_id")
        (out / "config.json").write_text(json.dumps(merged_cfg, indent=2))
    for f in ("chat_template.jinja",):
        if (base_dir / f).is_file() and not (out / f).is_file():
            shutil.copy(base_dir / f, out / f)


def save_merged(model, base_dir: Path, out: Path, dtype: str) -> None:
    """Write ``model`` (its current weights, cast to ``dtype``) as a HF checkpoint into ``out`` with the
    base's tokenizer, generation config, eos ids and chat template (:func:`copy_base_files`)."""
    from transformers import AutoTokenizer

    model.to("cpu").to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(out))
    copy_base_files(base_dir, out)
