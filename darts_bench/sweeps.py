"""Seeds and sweeps of the correction heads as first-class runs.

A run trains one set of heads per (merge, task, split) for every *variant* (a combination of the
``sweep.surgery`` values, e.g. ``w_max=2,max_len=256``) and every *head seed* (``seeds``; head init,
batch order and held-out split derive from it). Features are cached per (merge, task, split) and do
not depend on either, so a sweep only adds head training and evaluation.

Row names: ``<merge>+<method>[@split][<variant tag>][#s<seed>]``; the variant tag ``[w_max=2,...]``
appears only when a sweep is configured and ``#s<seed>`` only when ``seeds`` is set, so the default
(no sweep, ``seeds: null``) keeps today's row names and cache keys.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import yaml


def head_seeds(cfg) -> list[int]:
    """The head seeds of a run: ``cfg.seeds``, or ``[cfg.seed]`` when ``seeds`` is not set."""
    return list(cfg.seeds) if cfg.seeds else [cfg.seed]


def seed_tag(cfg, seed: int) -> str:
    """``#s<seed>`` when the run has a ``seeds`` list, else ``""`` (single-seed rows keep their name)."""
    return f"#s{seed}" if cfg.seeds else ""


def _fmt_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def surgery_variants(cfg) -> list[tuple[str, Any]]:
    """``[(tag, SurgeryConfig)]``: one entry per combination of ``cfg.sweep.surgery`` values, in the
    order the keys and values are listed (the last key varies fastest). Without a sweep:
    ``[("", cfg.surgery)]``.

    Raises:
        ValueError: a combination is not a valid surgery section (the message names it).
    """
    return surgery_grid(cfg.surgery, cfg.sweep)


def surgery_grid(surgery, sweep) -> list[tuple[str, Any]]:
    """:func:`surgery_variants` from a ``SurgeryConfig`` and a ``SweepConfig``."""
    from pydantic import ValidationError

    from darts_bench.config import SurgeryConfig

    grid = sweep.surgery
    if not grid:
        return [("", surgery)]
    keys = list(grid)
    base = surgery.model_dump(mode="json")
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        upd = dict(zip(keys, combo))
        tag = "[" + ",".join(f"{k}={_fmt_value(v)}" for k, v in upd.items()) + "]"
        try:
            out.append((tag, SurgeryConfig.model_validate({**base, **upd})))
        except ValidationError as e:
            msg = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in e.errors())
            raise ValueError(f"sweep {tag}: invalid surgery setting ({msg})") from None
    return out


def sweep_override(arg: str) -> str:
    """``--sweep surgery.KEY=v1,v2`` as the ``--set`` override ``sweep.surgery.KEY=[v1, v2]`` (each
    value YAML-parsed, as ``--set`` does).

    Raises:
        ValueError: not of the form ``surgery.KEY=v1[,v2...]``.
    """
    if "=" not in arg:
        raise ValueError(f"--sweep {arg!r}: expected surgery.KEY=v1,v2,...")
    key, vals = arg.split("=", 1)
    key = key.strip()
    if not key.startswith("surgery.") or key.count(".") != 1 or not vals.strip():
        raise ValueError(f"--sweep {arg!r}: expected surgery.KEY=v1,v2,... (only surgery.* settings are swept)")
    values = [yaml.safe_load(v.strip()) for v in vals.split(",")]
    return f"sweep.{key}={json.dumps(values)}"


def row_names(cfg) -> list[str]:
    """Every row name of ``cfg``, in table order, known without building anything: base,
    ``expert:<e>``, each merge, and its corrected rows (method, split, sweep variant, head seed)."""
    from darts_bench.config import EXPERT_NAMES

    names = ["base", *(f"expert:{e}" for e in EXPERT_NAMES)]
    for spec in cfg.merges:
        names.append(spec.name)
        for split in cfg.calibration.splits:
            suffix = "" if split == "transductive" else f"@{split}"
            for method in cfg.surgery.methods:
                for tag, _ in surgery_variants(cfg):
                    for seed in head_seeds(cfg):
                        names.append(f"{spec.name}+{method}{suffix}{tag}{seed_tag(cfg, seed)}")
    return names


def row_selected(cfg, name: str) -> bool:
    """Whether row ``name`` is evaluated (``evaluate.rows`` fnmatch patterns; every row when unset)."""
    from fnmatch import fnmatchcase

    pats = cfg.evaluate.rows
    return pats is None or any(fnmatchcase(name, p) for p in pats)


def needs_merges(cfg) -> bool:
    """False when ``evaluate.rows`` selects no merge or corrected row (merge, collect and train are
    then skipped: base and experts only)."""
    from darts_bench.config import EXPERT_NAMES

    plain = {"base", *(f"expert:{e}" for e in EXPERT_NAMES)}
    return any(row_selected(cfg, n) for n in row_names(cfg) if n not in plain)
