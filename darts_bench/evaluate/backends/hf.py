"""The HF backend (the reference): re-exports :mod:`darts_bench.evaluate.hf_model`."""

from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm

__all__ = ["HFTextModel", "load_causal_lm"]
