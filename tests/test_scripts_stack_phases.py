"""scripts/stack_phases.py recomputes the evaluate stage's phase tables of the smollm2-135m runs 6-9 and 17 (docs/performance.md;
their TIMINGS.md and logs: ``results/smollm2-135m-2026-12-03`` at 7c1b2ca, ``-2026-12-05-run17`` at e868c53 in git history)
from their py-spy driver stack samples, kept as fixtures in tests/fixtures/runs/stacks."""

from __future__ import annotations

from pathlib import Path

from conftest import load_script

RUN = Path(__file__).resolve().parent / "fixtures" / "runs" / "stacks"


def assert_phase_lines(capsys, samples: str, lines, *window: str) -> None:
    """``stack_phases.py`` over ``RUN / samples`` (``window``: ``--since HH:MM:SS --until HH:MM:SS``) prints every line."""
    sp = load_script("stack_phases")
    sp.main([str(RUN / samples), *window])
    out = capsys.readouterr().out
    for line in lines:
        assert line in out, (samples, window, line)


def test_committed_samples_give_the_timings_phase_table(capsys):
    sp = load_script("stack_phases")
    assert sp.main([str(RUN / "driver_stacks.txt.gz")]) == 0
    out = capsys.readouterr().out
    for line in ("| judge | 1,156 | 37% |", "| reference NLL | 853 | 28% |", "| generation | 663 | 21% |",
                 "| engine start | 226 | 7% |", "| routed prompt states | 59 | 2% |", "| all | 3,086 | |"):
        assert line in out
    # one window: the AdaMerging AlpacaEval pass, mostly the judge
    sp.main([str(RUN / "driver_stacks.txt.gz"), "--since", "09:10:26", "--until", "09:21:15"])
    assert "| judge | 488 |" in capsys.readouterr().out


def test_a_sample_without_a_working_thread_is_between_calls():
    sp = load_script("stack_phases")
    text = ("@@ 100\nThread 1 (idle): \"eval-x-gsm8k\"\n    Condition.wait (threading.py:327)\n"
            "@@ 103\nThread 1 (idle): \"eval-x-gsm8k\"\n    LLM.generate (vllm/llm.py:1)\n    RowView.generate (e.py:1)\n"
            "@@ 130\nThread 1 (active): \"eval-x-gsm8k\"\n    judge_completions (judge.py:1)\n")
    assert sp.phases(text) == {"between calls": 0, "generation": 3, "judge": 10}


def test_run7_windows_give_the_timings_comparison(capsys):
    """Run 7 (every score from the HF copy): TIMINGS.md's windows against run 6 recomputed from the samples."""
    for samples, since, until, judge, nll in (
            ("driver_stacks.txt.gz", "09:01:29", "09:21:15", "488", "338"),
            ("run7_driver_stacks.txt.gz", "12:26:23", "12:48:41", "648", "112"),
            ("driver_stacks.txt.gz", "08:48:23", "09:01:29", "297", "157"),
            ("run7_driver_stacks.txt.gz", "12:08:16", "12:26:23", "394", "257")):
        assert_phase_lines(capsys, samples, (f"| judge | {judge} |", f"| reference NLL | {nll} |"),
                           "--since", since, "--until", until)


def test_run8_samples_give_the_timings_table(capsys):
    """Run 8 (scoring: heads): the phase table and the merges' reference-NLL windows of TIMINGS.md."""
    assert_phase_lines(capsys, "run8_driver_stacks.txt.gz", ("| judge | 1,108 |", "| reference NLL | 408 |",
                       "| generation | 583 |", "| engine start | 181 |", "| all | 2,431 |"))
    for since, until, nll in (("13:07:31", "13:23:08", "126"), ("13:23:08", "13:35:50", "132")):
        assert_phase_lines(capsys, "run8_driver_stacks.txt.gz", (f"| reference NLL | {nll} |",),
                           "--since", since, "--until", until)


def test_run9_samples_give_the_timings_table(capsys):
    """Run 9 (scoring: shared): the phase table, the judge per window against run 8's, the stage time, the memo
    and the comparison line of TIMINGS.md."""
    assert_phase_lines(capsys, "run9_driver_stacks.txt.gz", ("| judge | 600 |", "| reference NLL | 464 |",
                       "| generation | 685 |", "| engine start | 238 |", "| all | 2,303 |"))
    for samples, since, until, judge in (
            ("run8_driver_stacks.txt.gz", "12:55:14", "13:07:31", "307"),
            ("run9_driver_stacks.txt.gz", "15:29:57", "15:41:53", "176"),
            ("run8_driver_stacks.txt.gz", "13:07:31", "13:23:08", "493"),
            ("run9_driver_stacks.txt.gz", "15:41:53", "15:56:08", "254"),
            ("run8_driver_stacks.txt.gz", "13:23:08", "13:35:50", "308"),
            ("run9_driver_stacks.txt.gz", "15:56:08", "16:07:50", "170")):
        assert_phase_lines(capsys, samples, (f"| judge | {judge} |",), "--since", since, "--until", until)


def test_a_busy_thread_caught_without_a_frame_is_named_not_a_crash():
    """run 13's dumps held an active thread with its header line only (py-spy caught it starting)."""
    sp = load_script("stack_phases")
    assert sp.classify('Thread 7 (active): "eval-m-gsm8k"\n') == "other: (no frame)"


def test_an_executor_frame_is_not_code_execution():
    """A train-stage thread running in darts_bench/executors is ``other``; HumanEval's program checks are code
    execution."""
    sp = load_script("stack_phases")
    train = ('Thread 5 (active): "MainThread"\n    Diagnostics.many (darts_bench/surgery/diagnostics.py:360)\n'
             '    LocalExecutor.map (darts_bench/executors/local.py:40)\n')
    assert sp.classify(train) == "other: Diagnostics.many (darts_bench/surgery/diagnostics.py:360)"
    code = ('Thread 6 (active): "eval-m-humaneval"\n    run_programs (darts_bench/sandbox/host.py:760)\n'
            '    check_programs (darts_bench/scoring/code.py:55)\n')
    assert sp.classify(code) == "code execution"


def test_a_window_across_midnight_reads_its_times_on_the_next_day(capsys):
    """Run 17 started at 23:55 and evaluated from 00:18:15 to 00:45:24 the next day: ``--since/--until`` more than
    12 h before the first sample's time of day are read on the day after it, giving its TIMINGS.md phases."""
    sp = load_script("stack_phases")
    sp.main([str(RUN / "run17_driver_stacks.txt.gz"), "--since", "00:18:15", "--until", "00:45:24"])
    out = capsys.readouterr().out
    for line in ("| generation | 555 | 34% |", "| judge | 399 | 24% |", "| reference NLL | 362 | 22% |",
                 "| engine start | 146 | 9% |", "| all | 1,630 | |"):
        assert line in out
