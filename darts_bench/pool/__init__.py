"""Model pools: a base model and its task experts (``tiny`` built here, ``gguf`` from a PyPI
wheel, ``hf`` from local dirs or hub ids)."""

from darts_bench.pool.build import Pool, build_pool, check_compatible

__all__ = ["Pool", "build_pool", "check_compatible"]
