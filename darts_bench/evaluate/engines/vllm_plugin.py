"""vLLM plugin entry point (``vllm.general_plugins`` -> ``darts_bench``, declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts (driver, engine core, workers), so the
spawned worker that builds the model knows ``DartsLlamaForCausalLM``; registering it only in the
driver process would not be enough. The class is registered by its import path, so loading the
plugin imports neither torch models nor vLLM's model code.
"""

from __future__ import annotations

ARCH = "DartsLlamaForCausalLM"
MODEL_CLASS = "darts_bench.evaluate.engines.vllm_model:DartsLlamaForCausalLM"


def register() -> None:
    """Register :class:`~darts_bench.evaluate.engines.vllm_model.DartsLlamaForCausalLM` with vLLM."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, MODEL_CLASS)
