"""vLLM plugin entry point (``vllm.general_plugins`` -> ``darts_bench``, declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts (driver, engine core, workers), so the
spawned worker that builds the model knows the ``Darts<Arch>`` classes; registering them only in
the driver process would not be enough. Every causal LM architecture vLLM has (``*ForCausalLM``)
gets a ``Darts<Arch>`` entry by its import path (:data:`MODULE` ``:Darts<Arch>``), so loading the
plugin imports neither torch models nor vLLM's model code, and the class itself is built only in
the process that loads that architecture
(:func:`~darts_bench.evaluate.engines.vllm_model.darts_model_class`).
"""

from __future__ import annotations

PREFIX = "Darts"  # = vllm_model.PREFIX (this module must not import vllm_model: it imports torch)
MODULE = "darts_bench.evaluate.engines.vllm_model"
MODEL_CLASS = f"{MODULE}:{PREFIX}LlamaForCausalLM"  # the Llama entry, e.g. for a quick check


def darts_arch(arch: str) -> str:
    """The registry name of ``arch`` with the head (``Qwen2ForCausalLM`` -> ``DartsQwen2ForCausalLM``)."""
    return PREFIX + arch


def register() -> None:
    """Register ``Darts<Arch>`` for every ``<Arch>ForCausalLM`` in vLLM's model registry (lazily:
    ``"module:Class"`` entries)."""
    from vllm import ModelRegistry

    have = set(ModelRegistry.get_supported_archs())
    for arch in sorted(have):
        if arch.endswith("ForCausalLM") and not arch.startswith(PREFIX) and darts_arch(arch) not in have:
            ModelRegistry.register_model(darts_arch(arch), f"{MODULE}:{darts_arch(arch)}")
