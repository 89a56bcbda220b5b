"""Generation engines (backends) behind the :class:`~darts_bench.api.TextModel` API, chosen once by
name from a lazy registry.

:data:`BACKENDS` (a :class:`~darts_bench.registry.Registry` of ``"module:Class"`` strings, imported
on first use):

* ``hf`` (default, the reference): :class:`darts_bench.evaluate.engines.hf.HFBackend`, transformers
  models with the head attached by hooks;
* ``vllm``: :class:`darts_bench.evaluate.engines.vllm.VLLMBackend`, one vLLM engine per model
  directory with the correction head inside vLLM's model class (``darts-bench[vllm]`` extra).

Each backend owns its local and Ray layouts, its model cache and its engines' lifetime
(:class:`~darts_bench.evaluate.engines.base.Backend`). The config names a backend per role:
``evaluate.backend`` (the evaluated rows) and ``calibration.backend`` (the experts' greedy
continuations in ``collect``); :func:`backend_name` is the one place that reads them.

The interface the stages call::

    check_backends(cfg)                         # before any stage: ImportError / ValueError
    key = backend_key(cfg, "evaluate")          # the engine's part of a cache key ({} for hf)
    with open_models(cfg, executor) as models:  # the evaluate stage's rows
        tm = models.get(row_name, model_dir, head_dir, pin=False)   # a TextModel; tm.close() after
    with open_models(cfg, executor, role="calibration") as backend:  # collect's continuations
        ids = backend.continuations(expert, expert_dir, prompt_ids, max_new_tokens)

This package imports no executor and nothing heavy at import time (the registry holds strings).
"""

from __future__ import annotations

from typing import Any

from darts_bench.evaluate.engines.base import Backend, HeldProxies
from darts_bench.registry import Registry

BACKENDS: Registry[type[Backend]] = Registry("backend", {
    "hf": "darts_bench.evaluate.engines.hf:HFBackend",
    "vllm": "darts_bench.evaluate.engines.vllm:VLLMBackend",
})

#: role -> the config key naming its backend
ROLES = {"evaluate": "evaluate.backend", "calibration": "calibration.backend"}


def backend_name(cfg, role: str = "evaluate") -> str:
    """The backend name the config gives ``role`` (``evaluate`` | ``calibration``).

    Raises:
        ValueError: unknown role.
    """
    if role == "evaluate":
        return cfg.evaluate.backend
    if role == "calibration":
        return cfg.calibration.backend
    raise ValueError(f"unknown backend role {role!r}; roles: {sorted(ROLES)}")


def backend_class(cfg, role: str = "evaluate") -> type[Backend]:
    """The :class:`Backend` subclass the config chooses for ``role`` (imported on first use).

    Raises:
        KeyError: the name is not in :data:`BACKENDS` (config validation normally catches it).
    """
    return BACKENDS.get(backend_name(cfg, role))


def check_backends(cfg) -> None:
    """Fail before any stage runs if the config asks for an engine this environment cannot run.

    Raises:
        ImportError: ``evaluate.backend`` or ``calibration.backend`` is ``vllm`` without vllm (the
            message names the key and the install command).
        ValueError: ``evaluate.backend`` or ``calibration.backend`` ``vllm`` on Ray with more
            tensor-parallel GPUs than an actor holds (both run their engines on Ray actors).
    """
    for role in ROLES:
        backend_class(cfg, role).check(cfg, role)


def backend_key(cfg, role: str = "evaluate") -> dict[str, Any]:
    """The part of an artifact's cache key that names ``role``'s engine: empty for ``hf`` (keys
    unchanged), the engine settings and dtype for ``vllm`` (``Backend.cache_key``)."""
    return backend_class(cfg, role).cache_key(cfg, role)


def open_models(cfg, executor, role: str = "evaluate", **options) -> Backend:
    """Open ``role``'s backend over the run's executor; close it (or use it as a context manager)
    when the stage is done: that releases its models, engines and actor groups.

    Args:
        cfg: the run's config.
        executor: the run's executor (``LocalExecutor`` | ``RayExecutor``).
        role: ``evaluate`` (``.get`` hands out the rows' text models) or ``calibration``
            (``.continuations`` makes the experts' continuations).
        **options: backend options (``batch_size``; ``merge_dirs``: the rows' merges, which the ``vllm`` backend
            scores on its HF copy under ``scoring: heads`` / ``shared``; ``engine_cls`` for ``vllm``).
    """
    return backend_class(cfg, role)(cfg, executor, role=role, **options)


__all__ = ["BACKENDS", "ROLES", "Backend", "HeldProxies", "backend_class", "backend_key", "backend_name",
           "check_backends", "open_models"]
