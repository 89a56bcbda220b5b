"""One readable progress bar per long stage, and third-party bars kept quiet.

``quiet_third_party()`` (called by the CLI unless ``-v``) sets, before those libraries are
imported, the public switches of the bars they draw: ``HF_HUB_DISABLE_PROGRESS_BARS`` (transformers'
"Loading weights", hub downloads), ``HF_DATASETS_DISABLE_PROGRESS_BARS`` ("Generating test split")
and ``TQDM_DISABLE`` (tqdm's own environment default, read when tqdm is imported: lm-eval's request
bars, alpaca_eval's "Annotation chunk"). :func:`overall_bar` passes ``disable=False`` explicitly, so
it is drawn either way; log lines are routed through it (``tqdm.contrib.logging``) so they do not
break the bar.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def quiet_third_party() -> list[str]:
    """Set the quiet switches that are not already set; returns those set. ``TQDM_DISABLE`` only
    takes effect when tqdm is not imported yet (it is read at import)."""
    done = []
    for k, v in QUIET_ENV.items():
        if k == "TQDM_DISABLE" and "tqdm" in sys.modules:
            continue
        if k not in os.environ:
            os.environ[k] = v
            done.append(k)
    return done


@contextlib.contextmanager
def overall_bar(total: int, desc: str, unit: str = "item") -> Iterator:
    """A tqdm bar over a stage's ``total`` units (rows x tasks for ``evaluate``; calibration sets and
    feature sets for ``collect``) with elapsed time and ETA, on stderr; console log lines are
    written above it (``tqdm.contrib.logging.logging_redirect_tqdm`` on the root logger)."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    # the console handlers of the root logger (darts_bench's records propagate there) write through tqdm
    with logging_redirect_tqdm():
        # not a terminal (a log file, CI): a refresh at most every 60 s, not several a second (each one a line in
        # a log file), and the final state when the stage ends
        bar = tqdm(total=total, desc=desc, unit=unit, disable=False, dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.1 if sys.stderr.isatty() else 60.0,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} "
                              "[{elapsed} elapsed, ETA {remaining}] {postfix}")
        try:
            yield bar
        finally:
            bar.close()
