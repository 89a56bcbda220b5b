"""EMR-Merging: one unified task vector, and per task a mask and a rescaler chosen at inference.

Source: Huang et al., NeurIPS 2024, "EMR-Merging: Tuning-Free High-Performance Model Merging"
(Elect, Mask & Rescale); code read: FusionBench 0.2.33 ``fusion_bench/method/emr_merging/utils.py``
(``emr_merge``, ``EMRTaskModulator.apply``; MIT licence), itself "modified from the original EMR
merging function" (harveyhuang18/EMR_Merging). With tau_k = theta_k - theta_base per parameter
tensor l (K experts)::

    gamma_uni[l] = sign(sum_k tau_k[l])               (+1 where the sum is > 0, else -1: zeros count as -1)
    mask_k[l]    = (tau_k[l] * gamma_uni[l]) > 0       (bool: the expert agrees with the elected sign)
    tau_uni[l]   = gamma_uni[l] * max_k |mask_k[l] * tau_k[l]|
    rescaler_k   = sum_l mean|tau_k[l]| / sum_l mean|mask_k[l] * tau_uni[l]|     (float32 scalar)
    theta_k'[l]  = theta_base[l] + (tau_uni[l] * mask_k[l]) * rescaler_k

(the rescaler sums each tensor's *mean* absolute value, as the reference code does, not the plain sum
over all elements of the paper's Eq. 5: the two differ by the tensors' sizes.) The tensors are the
base's ``named_parameters()`` (a tied input/output embedding once; buffers stay the base's), in float32.

EMR is *task-aware*: there is no single merged model; the model of task t is theta_k' of t's expert,
the same task-label budget as a Surgery or DARTS head. Its rows (:mod:`darts_bench.rows`): ``<merge>``
(oracle: every example of task t on t's expert's model) and ``<merge>[@split]@routed`` (a router picks
the expert per prompt from the *base* model's mean-pooled final hidden state of the prompt: the one
model every EMR task model shares before a modulator is applied; :func:`fit_emr_router`).

Storage (decided for SmolLM2-135M, 134.5M fp32 parameters = 538 MB a model): the merge dir keeps the
canonical record ``emr.safetensors`` (tau_uni in float32, each expert's mask bit-packed with
``numpy.packbits``: 17 MB an expert, and the rescalers), 589 MB for three experts against 1.61 GB for
three full checkpoints, and the per-task checkpoints are *materialised* from it under ``tasks/<expert>/``
in the same (cached) merge build, because every evaluation backend (HF in process, Ray actors, vLLM
engines) loads a checkpoint dir; applying masks at load would need a hook in each. The reconstruction is
elementwise float32 arithmetic, so a materialised checkpoint equals :func:`reconstruct` bit for bit
(tested). ``darts-bench export`` ships the merge dir (record and checkpoints).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from darts_bench.config import TASK_MODELS_DIR

log = logging.getLogger("darts_bench")
PAPER = "Huang et al., NeurIPS 2024, EMR-Merging: Tuning-Free High-Performance Model Merging"
CODE = "fusion-bench 0.2.33 fusion_bench/method/emr_merging/utils.py emr_merge (MIT)"
#: the file beside the per-task checkpoints with the rescalers, experts and tensor shapes
SUMMARY = "emr.json"
#: unified vector, bit-packed masks, rescalers
RECORD = "emr.safetensors"
#: subdir of the merge dir with one HF checkpoint per expert
TASKS_DIR = TASK_MODELS_DIR


def _sign(x: torch.Tensor) -> torch.Tensor:
    """+1 where ``x > 0``, else -1 (zeros are -1, as the reference code's ``_sign``)."""
    return (x > 0).to(x.dtype) * 2 - 1


def emr_merge(task_vectors: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                                     torch.Tensor]:
    """Elect, mask and rescale (module docstring's equations).

    Args:
        task_vectors: K dicts name -> tau_k tensor (float32; every dict has the same names and shapes).
    Returns:
        ``(tau_uni {name: tensor, float32}, masks {name: bool [K, *shape]}, rescalers float32 [K])``.
    Raises:
        ValueError: fewer than two task vectors, or their names / shapes differ (the first difference is named).
    """
    K = len(task_vectors)
    if K < 2:
        raise ValueError(f"EMR-Merging needs at least two experts' task vectors, got {K}")
    names = list(task_vectors[0])
    for k, tv in enumerate(task_vectors[1:], 1):
        bad = [n for n in names if n not in tv or tv[n].shape != task_vectors[0][n].shape] + \
            [n for n in tv if n not in task_vectors[0]]
        if bad:
            raise ValueError(f"EMR-Merging: task vector {k} differs from task vector 0 at {bad[:3]} (names or "
                             "shapes); every expert must have the base's parameters")
    unified, masks = {}, {}
    scales = torch.zeros(K)
    new_scales = torch.zeros(K)
    for n in names:
        taus = [tv[n].float() for tv in task_vectors]
        flag = _sign(sum(taus[1:], taus[0].clone()))  # the reference sums in list order
        m = torch.stack([(t * flag) > 0 for t in taus])  # [K, *shape]
        best = torch.zeros_like(taus[0])
        for k, t in enumerate(taus):
            a = torch.abs(m[k] * t)
            best = torch.where(a > best, a, best)
            scales[k] += torch.mean(torch.abs(t))
        unified[n] = best * flag
        masks[n] = m
    for k in range(K):
        for n in names:  # the reference's second loop: after every tensor's elected vector
            new_scales[k] += torch.mean(torch.abs(unified[n] * masks[n][k]))
    if (new_scales == 0).any():
        raise ValueError(f"EMR-Merging: experts {torch.nonzero(new_scales == 0).flatten().tolist()} agree with the "
                         "elected sign nowhere (their masked unified vector is zero): is an expert equal to the base?")
    return unified, masks, scales / new_scales


def reconstruct(base: dict[str, torch.Tensor], unified: dict[str, torch.Tensor], mask: dict[str, torch.Tensor],
                rescaler: torch.Tensor | float) -> dict[str, torch.Tensor]:
    """theta_k' = theta_base + (tau_uni * mask_k) * rescaler_k per tensor (the reference's
    ``EMRTaskModulator.apply``: ``param.add_(unified * mask * rescaler)``).

    Args: base, unified: name -> float32 tensor; mask: name -> bool tensor of one expert; rescaler: its scalar.
    Returns: name -> float32 tensor (a new dict; ``base`` is not changed)."""
    r = torch.as_tensor(rescaler, dtype=torch.float32)
    return {n: base[n] + unified[n] * mask[n] * r for n in unified}


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 bits (``numpy.packbits``, big-endian bit order, flattened): [ceil(numel / 8)]."""
    return torch.from_numpy(np.packbits(mask.flatten().cpu().numpy().astype(np.uint8)))


def unpack_mask(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: bool tensor of ``shape``."""
    n = int(np.prod(shape)) if shape else 1
    return torch.from_numpy(np.unpackbits(bits.numpy(), count=n).astype(bool)).reshape(shape)


def save_record(out: Path, experts: list[str], unified: dict[str, torch.Tensor], masks: dict[str, torch.Tensor],
                rescalers: torch.Tensor) -> None:
    """``out/emr.safetensors``: ``unified.<name>`` (float32), ``mask.<k>.<name>`` (uint8 bits, :func:`pack_mask`),
    ``rescalers`` (float32 [K]); the shapes and experts go to :data:`SUMMARY` (see :func:`load_record`)."""
    from safetensors.torch import save_file

    t = {f"unified.{n}": v.contiguous() for n, v in unified.items()}
    for n, m in masks.items():
        for k in range(len(experts)):
            t[f"mask.{k}.{n}"] = pack_mask(m[k])
    t["rescalers"] = rescalers.float().contiguous()
    save_file(t, str(out / RECORD), metadata={"experts": json.dumps(experts)})


def load_record(merge_dir: Path) -> tuple[list[str], dict[str, torch.Tensor], dict[str, list[torch.Tensor]],
                                          torch.Tensor]:
    """``(experts, unified, masks {name: [bool tensor per expert]}, rescalers [K])`` from a merge dir's record.

    Raises:
        FileNotFoundError: no :data:`RECORD` in ``merge_dir`` (not an EMR merge)."""
    from safetensors import safe_open

    path = Path(merge_dir) / RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no EMR record (is {merge_dir} an emr merge dir?)")
    with safe_open(str(path), "pt") as f:
        experts = json.loads(f.metadata()["experts"])
        unified = {k[len("unified."):]: f.get_tensor(k) for k in f.keys() if k.startswith("unified.")}
        masks = {n: [unpack_mask(f.get_tensor(f"mask.{k}.{n}"), tuple(u.shape)) for k in range(len(experts))]
                 for n, u in unified.items()}
        rescalers = f.get_tensor("rescalers")
    return experts, unified, masks, rescalers


def task_dir(merge_dir: Path, expert: str) -> Path:
    """The materialised checkpoint of ``expert``'s EMR model in a merge dir."""
    return Path(merge_dir) / TASKS_DIR / expert


def build_emr(spec, base_dir: Path, experts: dict[str, Path], cfg, out: Path) -> dict:
    """Build merge ``spec`` into ``out``: :data:`RECORD`, ``tasks/<expert>/`` (one HF checkpoint per expert,
    :func:`darts_bench.merge.data.save_merged`) and :data:`SUMMARY` (rescalers, the share of each expert's
    entries its mask keeps, sizes). Returns the summary dict.

    Raises:
        ValueError: an expert lacks a parameter of the base or reshapes it (``pool.vocab_alignment: base``
            with appended tokens is not supported), or :func:`emr_merge`'s errors."""
    from darts_bench.merge.data import load_model, save_merged

    names = list(experts)
    model = load_model(base_dir, "cpu")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    taus = []
    for e in names:
        m = load_model(experts[e], "cpu")
        sd = dict(m.named_parameters())
        bad = [n for n in base if n not in sd or sd[n].shape != base[n].shape]
        if bad:
            raise ValueError(f"emr merge {spec.name!r}: expert {e!r} lacks (or reshapes) parameter(s) {bad[:3]} of "
                             "the base; EMR-Merging needs experts of the base's shapes")
        taus.append({n: sd[n].detach().float() - base[n] for n in base})
        del m, sd
    unified, masks, rescalers = emr_merge(taus)
    del taus
    save_record(out, names, unified, masks, rescalers)
    for k, e in enumerate(names):
        theta = reconstruct(base, unified, {n: masks[n][k] for n in unified}, rescalers[k])
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(theta[n])
        d = task_dir(out, e)
        d.mkdir(parents=True)
        save_merged(model, base_dir, d, "float32")
    n_params = sum(v.numel() for v in unified.values())
    record = {"method": "emr", "paper": PAPER, "code": CODE, "experts": names,
              "rescalers": {e: float(rescalers[k]) for k, e in enumerate(names)},
              "mask_density": {e: float(sum(int(masks[n][k].sum()) for n in masks) / n_params)
                               for k, e in enumerate(names)},
              "parameters": n_params, "tensors": len(unified),
              "record_bytes": (out / RECORD).stat().st_size, "task_models": {e: f"{TASKS_DIR}/{e}" for e in names}}
    (out / SUMMARY).write_text(json.dumps(record, indent=1))
    log.info("emr %s: rescalers %s, mask density %s", spec.name, {e: round(v, 4) for e, v in record["rescalers"].items()},
             {e: round(v, 3) for e, v in record["mask_density"].items()})
    return record


__all__ = ["build_emr", "emr_merge", "load_record", "pack_mask", "reconstruct", "save_record", "task_dir",
           "unpack_mask"]
