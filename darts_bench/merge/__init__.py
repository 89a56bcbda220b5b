"""The merges: mergekit's methods through its Python API; the SVD merges TSV-M, Iso-C, Iso-CTS and the
post-merge SVC (:mod:`darts_bench.merge.svd`, FusionBench's computations without its runtime); and the data
merges AdaMerging and RegMean (:mod:`darts_bench.merge.adamerging`, :mod:`darts_bench.merge.regmean`), which
no installable library offers for a HF causal-LM pool (their module docstrings say why)."""

from darts_bench.merge.build import build_merges, merge_details
from darts_bench.merge.mergekit_merge import merge_config_dict, run_one_merge

__all__ = ["build_merges", "merge_config_dict", "merge_details", "run_one_merge"]
