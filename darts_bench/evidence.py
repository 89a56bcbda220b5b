"""Constants of what counts as evidence, shared by the train stage, the report tables and the claims
(a neutral module: it imports nothing of darts-bench, so every layer may import it).

* :data:`MIN_SEQUENCES`: a per-cell sequence-bootstrap interval over fewer held-out sequences than
  this is descriptive, never a verdict. 20 because a percentile bootstrap over 6 sequences covered
  a nominal 95% interval only 86% (normal) / 74% (skewed) of the time in simulation (issue 26); the
  packaged configs hold out at least this many sequences per (merge, task, split).
* :data:`RUN_N_BOOT`: resamples of the per-run sequence-bootstrap intervals in ``diagnostics.json``.
* :data:`TIE_RTOL`: two values closer than this (relative) are a tie, not a win or a loss: the behaviour
  signals and reference NLLs are float32 sums (a bfloat16 or float16 model still computes them in float32),
  so differences below a few dozen float32 epsilons are rounding (issue 56: routed rows at routing accuracy
  1 differed from their oracle rows by 4e-9 to 3e-8 nats/token and counted as losses at 1e-9).
"""

from __future__ import annotations

#: fewest held-out sequences behind a per-cell interval that may carry a verdict
MIN_SEQUENCES = 20
#: resamples of every per-run diagnostics interval (the train stage's; ``report --from-results`` redraws them)
RUN_N_BOOT = 200
#: relative tie tolerance of paired comparisons: 64 float32 epsilons (2^-23 each), about 7.6e-6
TIE_RTOL = 64 * 2.0 ** -23


def held_out_count(n_sequences: int, held_out_fraction: float) -> int:
    """Sequences held out of ``n_sequences`` (>= 2) at ``held_out_fraction``: the rounded share, at
    least one and leaving at least one to train on (what
    :func:`darts_bench.surgery.train.split_by_sequence` holds out; the planner counts with it)."""
    return min(max(1, round(n_sequences * held_out_fraction)), n_sequences - 1)
