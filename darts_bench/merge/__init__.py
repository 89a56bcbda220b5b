"""The merges: mergekit's methods through its Python API; the SVD merges TSV-M, Iso-C, Iso-CTS and the
post-merge SVC (:mod:`darts_bench.merge.svd`, FusionBench's computations without its runtime); the data
merges AdaMerging, RegMean and Expert Merging (:mod:`darts_bench.merge.adamerging`,
:mod:`darts_bench.merge.regmean`, :mod:`darts_bench.merge.expert_merging`), which no installable library
offers for a HF causal-LM pool (their module docstrings say why); and the task-aware EMR-Merging
(:mod:`darts_bench.merge.emr`, one model per task)."""

from darts_bench.merge.build import build_merges, merge_details
from darts_bench.merge.mergekit_merge import merge_config_dict, run_one_merge

__all__ = ["build_merges", "merge_config_dict", "merge_details", "run_one_merge"]
