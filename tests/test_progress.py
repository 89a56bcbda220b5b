"""Progress people can read: third-party bars off unless -v, our overall bar drawn either way."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers

REPO = Path(__file__).resolve().parent.parent
SCRIPT = """
import sys
from darts_bench.cli import _setup_logging
_setup_logging(sys.argv[1] == "-v")
import transformers.utils.logging as tl
import datasets
import tqdm
from darts_bench.progress import overall_bar
print("transformers", tl.is_progress_bar_enabled())
print("datasets", datasets.is_progress_bar_enabled())
print("tqdm_default_disabled", tqdm.tqdm(range(2), file=sys.stdout).disable)
import logging
with overall_bar(4, "evaluate", unit="row x task") as bar:
    logging.getLogger("darts_bench").info("a log line inside the bar")
    bar.update(4)
"""


def _run(flag: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", SCRIPT, flag], capture_output=True, text=True, env=env,
                          timeout=300, check=True)


def test_third_party_bars_quiet_unless_verbose_and_overall_bar_has_eta():
    quiet = _run("-q")
    assert "transformers False" in quiet.stdout and "datasets False" in quiet.stdout
    assert "tqdm_default_disabled True" in quiet.stdout
    assert "evaluate: 100%" in quiet.stderr and "4/4 row x task" in quiet.stderr and "ETA" in quiet.stderr
    # a log line during the bar is written once, through tqdm (not again by the root handler)
    assert quiet.stderr.count("a log line inside the bar") == 1
    loud = _run("-v")
    assert "transformers True" in loud.stdout and "datasets True" in loud.stdout
    assert "tqdm_default_disabled False" in loud.stdout


def test_cli_main_quiets_tqdm_before_the_parser_imports_task_folders():
    """build_parser imports the task folders (and with them tqdm): the switch must come first."""
    script = ("import sys\nfrom darts_bench.cli import main\n"
              "assert main(['run', '--dry-run', '--suite', 'gsm8k']) == 0\n"
              "import tqdm\nprint('after_main', tqdm.tqdm(range(2), file=sys.stdout).disable)\n")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         check=True)
    assert "after_main True" in res.stdout
