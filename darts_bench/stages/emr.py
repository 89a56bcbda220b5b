"""The routers of the task-aware merges' ``@routed`` rows (EMR-Merging, :mod:`darts_bench.merge.emr`).

An EMR row needs the task to choose the task's mask and rescaler. The ``<merge>@routed`` row replaces the
label with a router (:mod:`darts_bench.surgery.routing`, ``surgery.routing``: nearest centroid or probe),
which reads the **base** model's final hidden state mean-pooled over the prompt
(``HFTextModel.prompt_states``): the one model every EMR task model shares before a mask is chosen (there
is no merged model to read, unlike a head row's router, which reads its merge). It is fitted per
calibration split on the calibration prompts the heads use (:func:`darts_bench.merge.data.prompts_by_task`),
their training part under the run seed (:func:`darts_bench.surgery.train.split_by_sequence`, the heads'
``held_out_fraction`` and split seeds), and scored on the held-out part (``routing.json``, as a head
router's), and every calibration prompt's routed task is kept (``sequences_routed``) for the routed row's
behaviour evidence (:func:`darts_bench.stages.train.task_aware_runs`). The evaluate stage routes each benchmark prompt with the same ``prompt_states`` (the backend's
base model in process, else an HF copy: :func:`darts_bench.evaluate.routed.prompt_state_source`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from darts_bench.artifacts import cached, stable_hash

log = logging.getLogger("darts_bench")
#: what an EMR router artifact holds (in its key): 2 adds ``sequences_routed`` (every calibration prompt's routed task)
EMR_ROUTER_VERSION = 2


def emr_router_key(cfg, pool, prompts: dict, split: str) -> str:
    """Cache key of one task-aware router: the base's key, the prompts (:func:`darts_bench.merge.data.data_key`),
    the split, held-out fraction and run seed, ``surgery.routing``, the states' numerics (``tasks.batch_size``,
    ``pool.dtype``, device), :data:`~darts_bench.surgery.routing.ROUTER_VERSION` and :data:`EMR_ROUTER_VERSION`."""
    from darts_bench.merge.data import data_key
    from darts_bench.surgery.routing import ROUTER_VERSION

    return stable_hash({"base": pool.model_key("base"), "data": data_key(prompts, cfg), "split": split,
                        "held_out": cfg.calibration.held_out_fraction, "seed": cfg.seed,
                        "routing": cfg.surgery.routing.model_dump(mode="json"), "batch_size": cfg.tasks.batch_size,
                        "dtype": cfg.pool.dtype, "version": ROUTER_VERSION,
                        "emr_version": EMR_ROUTER_VERSION})


def emr_routers(cfg, pool, merges: dict[str, Path], loaded, work_dir: Path) -> dict[tuple[str, str, None], Path]:
    """One router per (task-aware merge in ``merges``, calibration split), cached under
    ``routers/<merge>-<split>-<key>/`` (``router.json``, ``routing.json`` with per task ``train_sequences``,
    ``held_out_sequences``, ``held_out_routed``, ``held_out_acc``, ``train_acc`` and ``sequences_routed``: the
    routed task of every calibration prompt in sequence-index order, the router's training prompts included: the
    routed row's evidence under a head seed other than the run seed reads it, and there some of its held-out
    prompts were the router's training prompts).

    Returns:
        ``{(merge, split, None): router dir}`` (no head seed: EMR rows have none).
    Raises:
        ValueError: fewer than two tasks with an expert (nothing to route between)."""
    from darts_bench.evaluate.engines.hf import load_text_model
    from darts_bench.merge.data import prompts_by_task
    from darts_bench.stages.train import split_seed, write_router
    from darts_bench.surgery.train import split_by_sequence

    out: dict[tuple[str, str, None], Path] = {}
    for spec in cfg.merges:
        if not spec.task_aware or spec.name not in merges:
            continue
        for split in cfg.calibration.splits:
            prompts = prompts_by_task(cfg, loaded, split)
            final = work_dir / "routers" / f"{spec.name}-{split}-{emr_router_key(cfg, pool, prompts, split)}"

            def build(tmp: Path, prompts=prompts, split=split) -> None:
                states = load_text_model(pool.base, "emr-router-states", device=cfg.device, dtype=cfg.pool.dtype,
                                         batch_size=cfg.tasks.batch_size)
                try:
                    by_task = {name: (np.asarray(states.prompt_states(ps), dtype=np.float64),
                                      *split_by_sequence(len(ps), cfg.calibration.held_out_fraction,
                                                         split_seed(cfg.seed, name, split)))
                               for name, (_, ps) in prompts.items()}
                finally:
                    if hasattr(states, "close"):
                        states.close()
                write_router(tmp, by_task, cfg.surgery.routing, every_prompt=True, extra={"states": "base"})

            cached(final, build, what=f"fit router {spec.name}/{split} (base prompt states)",
                   meta={"kind": "router", "merge": spec.name, "split": split, "states": "base"})
            out[(spec.name, split, None)] = final
    return out


__all__ = ["emr_router_key", "emr_routers"]
